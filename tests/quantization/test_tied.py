"""The tied output projection (a family's ``quantization_tied``; ``OASR_INT8_TIED_OUTPUT=0``
keeps it float): Whisper's logits through an int8 copy of the embedding table on the CPU with
two-term int8 activations, its exact integer products against the float64 reference, and the
version-2 checkpoint's round trip (a checkpoint that did not list it keeps it float)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import rel_err, whisper_net  # noqa: E402

from oasr.layers.quantized import QuantizedLinear  # noqa: E402
from oasr.quantization.numerics import reference_linear  # noqa: E402


@pytest.fixture()
def tied_on(monkeypatch):
    from oasr.quantization.apply import TIED_ENV

    monkeypatch.delenv(TIED_ENV, raising=False)


def _model():
    return SimpleNamespace(name="whisper-test", network=whisper_net(seed=3))


def test_switch_keeps_it_float(monkeypatch):
    from oasr.quantization.apply import TIED_ENV, quantize_model, tied_applies

    monkeypatch.setenv(TIED_ENV, "0")
    assert not tied_applies("int8_w8a8", "cpu")
    model = _model()
    report = quantize_model(model, "int8_w8a8")
    assert model.network.decoder.output_projection is None
    assert "network.decoder.output_projection" in report.kept


def test_tied_projection_is_int8_rows_of_the_embedding_on_cpu(tied_on):
    from oasr.quantization.apply import quantize_model, tied_applies

    model = _model()
    table = model.network.decoder.embed_tokens.weight.detach().clone()
    report = quantize_model(model, "int8_w8a8")
    proj = model.network.decoder.output_projection
    assert "network.decoder.output_projection" in report.quantized
    assert isinstance(proj, QuantizedLinear) and proj.bias is None
    assert (proj.out_features, proj.in_features) == tuple(table.shape)
    # one scale per vocabulary row; the lookup table itself is untouched
    assert torch.equal(model.network.decoder.embed_tokens.weight, table)
    back = proj.qweight.float() * proj.weight_scale[:, None]
    assert float((back - table).abs().max()) <= float(proj.weight_scale.max()) / 2 + 1e-7
    h = torch.randn(5, table.shape[1], generator=torch.Generator().manual_seed(0))
    # activations as two int8 terms per token: the second quantizes the first's rounding error
    assert proj.act_terms == 2
    got = model.network.decoder.logits(h)
    # (7-bit terms where FBGEMM's AVX2 path runs it: QuantizedLinear.act_qmax)
    want = reference_linear(h, proj.qweight, proj.weight_scale, None, "int8", act_terms=2,
                            act_qmax=proj.act_qmax(h.device))  # fmt: skip
    assert rel_err(got, want) < 1e-5
    # quantization moves the logits far more than the GEMM path differs from its reference,
    # and the second term removes most of the activations' share of the error
    assert rel_err(h @ table.t(), want) > 100 * rel_err(got, want)
    one_term = reference_linear(h, proj.qweight, proj.weight_scale, None, "int8")
    weights_only = h.double() @ back.double().t()
    assert rel_err(want, weights_only) < rel_err(one_term, weights_only) / 20
    assert tied_applies("int8_w8a8", "cpu")
    assert not tied_applies("fp8_w8a8", "cpu") and not tied_applies("int8_w8a8", "cuda")


def test_fp8_and_explicit_off_keep_the_float_projection(tied_on):
    from oasr.quantization.apply import quantize_model

    for method, tied in (("fp8_w8a8", None), ("int8_w8a8", False)):
        model = _model()
        report = quantize_model(model, method, tied=tied)
        assert model.network.decoder.output_projection is None
        assert "network.decoder.output_projection" in report.kept


def test_checkpoint_round_trip_and_older_checkpoints(tmp_path, tied_on):
    from oasr.checkpoint import NATIVE_CONFIG
    from oasr.quantization.apply import quantize_model
    from oasr.quantization.checkpoint import apply_saved, write_quantized

    model = _model()
    (tmp_path / NATIVE_CONFIG).write_text("{}")
    write_quantized(model, tmp_path, quantize_model(model, "int8_w8a8"), {"recipe": "w8a8"})
    block = json.loads((tmp_path / NATIVE_CONFIG).read_text())["quantization"]
    assert "network.decoder.output_projection" in block["layers"]
    h = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))

    loaded = _model()  # the same float weights (same seed)
    apply_saved(loaded, tmp_path, block, None)
    proj = loaded.network.decoder.output_projection
    assert torch.equal(proj.qweight, model.network.decoder.output_projection.qweight)
    assert torch.equal(loaded.network.decoder.logits(h), model.network.decoder.logits(h))

    # written before the projection was quantized: it is not listed, so it stays float
    older = dict(block, layers=[n for n in block["layers"] if not n.endswith("output_projection")])
    old = _model()
    apply_saved(old, tmp_path, older, None)
    assert old.network.decoder.output_projection is None
    dec = old.network.decoder
    assert torch.equal(dec.logits(h), dec.embed_tokens.unembed(h))

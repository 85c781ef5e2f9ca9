"""Linears a family keeps float where the CPU has no int8 GEMM (``quantization_keep_without_int8_gemm``;
Whisper: the decoder's): kept only there (int8 runs as float32 matmuls), switchable, part of the
quantized-weight cache's key, and not applied when a saved checkpoint quantized them."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import whisper_logits, whisper_net  # noqa: E402

from oasr.layers import quantized as Q  # noqa: E402
from oasr.layers.basic import Linear  # noqa: E402
from oasr.layers.quantized import QuantizedLinear  # noqa: E402
from oasr.quantization import cache  # noqa: E402
from oasr.quantization.apply import NO_INT8_GEMM_KEEP_ENV, no_int8_gemm_kept, quantize_model  # noqa: E402


@pytest.fixture
def gemm_path(monkeypatch):
    """Set whether the CPU's int8 GEMM is float32 matmuls (restored after)."""

    def use(float32: bool) -> None:
        monkeypatch.setattr(Q, "_INT_MM_SLOW", [float32])

    monkeypatch.delenv(NO_INT8_GEMM_KEEP_ENV, raising=False)
    return use


def _model():
    return SimpleNamespace(name="whisper-test", network=whisper_net(seed=3))


def _decoder_linears(model) -> dict[str, object]:
    return {n: m for n, m in model.network.named_modules() if n.startswith("decoder.layers.")
            and isinstance(m, (Linear, QuantizedLinear))}  # fmt: skip


def test_decoder_kept_only_without_int8_gemm(gemm_path, monkeypatch):
    gemm_path(True)
    model = _model()
    report = quantize_model(model, "int8_w8a8", prepack=False)
    dec = _decoder_linears(model)
    assert dec and not any(isinstance(m, QuantizedLinear) for m in dec.values())
    assert {f"network.{n}" for n in dec} <= set(report.kept) and {f"network.{n}" for n in dec} == no_int8_gemm_kept(model)
    assert "network.decoder.output_projection" in report.quantized  # the tied table stays int8
    assert any(n.startswith("network.encoder.layers.") for n in report.quantized)
    # still quantized: the logits differ from float32's, and stay within the families' bound
    torch.manual_seed(0)
    mel, tokens = torch.randn(1, 80, 3000), torch.randint(0, 96, (1, 6))
    ref = _model()
    with torch.no_grad():
        got, want = whisper_logits(model.network, mel, tokens), whisper_logits(ref.network, mel, tokens)
    err = float((got - want).abs().max()) / float(want.abs().max())
    assert 0 < err < 5e-2

    for float32, env, keep in ((False, None, False), (True, "0", False), (True, "1", True)):
        gemm_path(float32)
        if env is None:
            monkeypatch.delenv(NO_INT8_GEMM_KEEP_ENV, raising=False)
        else:
            monkeypatch.setenv(NO_INT8_GEMM_KEEP_ENV, env)
        m = _model()
        quantize_model(m, "int8_w8a8", prepack=False)
        assert all(isinstance(x, QuantizedLinear) != keep for x in _decoder_linears(m).values())


@pytest.mark.parametrize("float32", [True, False])
def test_saved_checkpoints_layer_set_wins(gemm_path, float32):
    """checkpoint.py passes ``no_int8_gemm_keep`` as the saved checkpoint has it, whatever this
    CPU: False (written where there is an int8 GEMM) quantizes the decoder, True keeps it."""
    gemm_path(float32)
    m = _model()
    report = quantize_model(m, "int8_w8a8", prepack=False, no_int8_gemm_keep=False)
    assert no_int8_gemm_kept(m) <= set(report.quantized)
    m = _model()
    report = quantize_model(m, "int8_w8a8", prepack=False, no_int8_gemm_keep=True)
    assert no_int8_gemm_kept(m) <= set(report.kept) and not no_int8_gemm_kept(m) & set(report.quantized)


def test_cache_key_follows_the_keep(gemm_path, tmp_path, monkeypatch):
    monkeypatch.setenv(cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights")
    gemm_path(True)
    assert not quantize_model(_model(), "int8_w8a8", source=src, prepack=False).cached
    assert quantize_model(_model(), "int8_w8a8", source=src, prepack=False).cached
    gemm_path(False)  # the decoder quantized too: another entry, not a partial one adopted
    r = quantize_model(_model(), "int8_w8a8", source=src, prepack=False)
    assert not r.cached and any(n.startswith("network.decoder.layers.") for n in r.quantized)

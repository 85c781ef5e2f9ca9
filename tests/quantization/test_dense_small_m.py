"""fp8 layers' dense path for a decode step's few rows (``QuantizedLinear.keep_dense_weight``):
the quantized weight dequantized once, the activations unquantized (W8A16), against its float64
reference; its error against the unquantized float64 layer next to W8A8's and a per-tensor
activation scale's; rows independent of each other; the switch; which of a Whisper decoder's
layers keep a copy."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import rel_err, whisper_net  # noqa: E402


def _layer(k=64, n=48, seed=0, smoothed=False):
    import oasr.layers as L
    from oasr.layers.quantized import QuantizedLinear

    torch.manual_seed(seed)
    lin = L.Linear(k, n)
    scale = torch.rand(k) + 0.5 if smoothed else None
    return QuantizedLinear.from_linear(lin, "fp8_w8a8", input_scale=scale)


@pytest.mark.parametrize("smoothed", [False, True])
def test_dense_path_matches_its_float64_reference(smoothed):
    from oasr.quantization.numerics import reference_dense_linear, reference_linear

    q = _layer(smoothed=smoothed)
    plain = _layer(smoothed=smoothed)
    assert q.keep_dense_weight(rows=8) == 48 * 64 * 4
    copy = q.dense_weight
    assert q.keep_dense_weight(rows=8) == 48 * 64 * 4 and q.dense_weight is copy  # made once
    x = torch.randn(2, 4, 64)  # 8 rows: the dense path
    ref = q(x.double())
    want = reference_dense_linear(x, q.weight_q, q.weight_scale, q.bias, q.input_scale)
    torch.testing.assert_close(ref, want, rtol=0, atol=0)
    assert rel_err(q(x), ref) < 1e-6
    # 9 rows: the fp8 GEMM, exactly what a layer without the copy computes
    x9 = torch.randn(9, 64)
    assert torch.equal(q(x9), plain(x9))
    ref9 = reference_linear(x9, q.weight_q, q.weight_scale, q.bias, "fp8", q.input_scale)
    torch.testing.assert_close(q(x9.double()), ref9, rtol=0, atol=0)


def test_dense_is_closer_to_the_unquantized_layer_than_w8a8():
    """Whisper large-v3's decoder shapes in float64 (weights ~N(0, 0.02) with channel
    magnitudes spread e^N(0,1), activations with a few outlier channels): the dense path's
    output error is the weight's rounding only (about 2.6 %), W8A8 adds the activations'
    (about 3.4 %). Per-tensor activation scales would be about as accurate (e4m3's exponent
    keeps small rows' relative precision) but mix the rows of a batch (the next test)."""
    from oasr.layers.quantized import QuantizedLinear
    from oasr.quantization.numerics import reference_dense_linear, reference_linear

    g = torch.Generator().manual_seed(0)
    for n, k in ((3840, 1280), (1280, 5120)):
        w = torch.randn(n, k, generator=g, dtype=torch.float64) * 0.02
        w *= torch.exp(torch.randn(n, 1, generator=g, dtype=torch.float64))
        x = torch.randn(64, k, generator=g, dtype=torch.float64)
        x[:, :4] *= 20
        q = QuantizedLinear.from_weight(w.float(), None, "fp8_w8a8")
        exact = x @ w.t()
        dense = rel_err(reference_dense_linear(x, q.weight_q, q.weight_scale, None), exact)
        w8a8 = rel_err(reference_linear(x, q.weight_q, q.weight_scale, None, "fp8"), exact)
        assert dense < 0.03 and dense < 0.85 * w8a8, (n, k, dense, w8a8)


def test_rows_stay_independent_of_each_other():
    """A request's output does not depend on what is batched with it: per-token activation
    scales (W8A8) and the dense path compute each row alone. A per-tensor activation scale
    would not: a row beside a 1000x larger one is quantized on a coarser grid (checked here on
    the bare rounding, the reason the GEMM path keeps per-token scales)."""
    from oasr.quantization.numerics import FP8_DTYPE

    torch.manual_seed(1)
    batch = torch.randn(16, 64)
    batch[0] *= 1000
    for rows in (0, 32):  # W8A8, then the dense path
        q = _layer()
        if rows:
            q.keep_dense_weight(rows=rows)
        together = q(batch)
        for i in (1, 7, 15):
            torch.testing.assert_close(together[i], q(batch[i : i + 1])[0], rtol=1e-6, atol=1e-6)
    row = batch[1:2].double()

    def per_tensor(x, amax):
        s = amax / 448
        return (x / s).to(FP8_DTYPE).double() * s

    assert not torch.equal(per_tensor(row, row.abs().max()), per_tensor(row, batch.abs().max().double()))


def test_switch_and_formats(monkeypatch):
    import oasr.layers as L
    from oasr.layers.quantized import QuantizedLinear, dense_rows_limit, keep_dense_weights

    assert dense_rows_limit() == 256
    monkeypatch.setenv("OASR_FP8_DENSE_ROWS", "0")
    assert dense_rows_limit() == 0
    q = _layer()
    assert keep_dense_weights([q, torch.nn.ReLU()]) == 0 and q.dense_weight is None
    monkeypatch.setenv("OASR_FP8_DENSE_ROWS", "12")
    assert keep_dense_weights([q]) == 48 * 64 * 4 and q.dense_rows == 12
    int8 = QuantizedLinear.from_linear(L.Linear(32, 16), "int8_w8a8")
    assert int8.keep_dense_weight() == 0 and int8.dense_weight is None
    # not saved; converted with the layer
    assert "dense_weight" not in q.state_dict()
    q.half()
    assert q.dense_weight.dtype == torch.float16 and q.weight_scale.dtype == torch.float32
    x = torch.randn(3, 64, dtype=torch.float16)
    torch.testing.assert_close(q(x), torch.nn.functional.linear(x, q.dense_weight, q.bias))


def test_whisper_step_model_keeps_copies_of_the_decode_layers():
    from oasr.layers.quantized import QuantizedLinear
    from oasr.quantization.apply import quantize_module
    from oasr_models_whisper.engine_adapter import WhisperStepModel

    net = whisper_net(seed=3, d=64)
    quantize_module(net, "fp8_w8a8")
    step = WhisperStepModel(net)  # on the CPU: no copies
    assert not any(isinstance(m, QuantizedLinear) and m.dense_weight is not None for m in net.modules())
    added = step._keep_dense_decode_weights()
    kept = {n for n, m in net.named_modules() if isinstance(m, QuantizedLinear) and m.dense_weight is not None}
    want = {f"decoder.layers.{i}.{p}" for i in range(2) for p in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
        "cross_attn.q_proj", "cross_attn.out_proj", "mlp.fc1", "mlp.fc2")}  # fmt: skip
    assert kept == want
    assert added == sum(net.get_submodule(n).dense_weight.numel() * 4 for n in want)
    # a decode step through the copies against the float64 reference of the same layers
    torch.manual_seed(0)
    h = torch.randn(4, 1, 64)
    mlp = net.decoder.layers[0].mlp
    torch.testing.assert_close(mlp(h).double(), mlp(h.double()), rtol=1e-5, atol=1e-5)

"""Each GEMM path of QuantizedLinear against the float64 fake-quantized reference of the same
quantized math (oasr.quantization.numerics), plus the weight/activation quantizers themselves."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import rel_err  # noqa: E402

import oasr.layers as L  # noqa: E402
from oasr.layers.quantized import QuantizedLinear  # noqa: E402
from oasr.quantization.numerics import (  # noqa: E402
    FP8_MAX,
    dequantize_weight,
    quantize_activations,
    quantize_weight,
    reference_linear,
)


def _linear(k: int, n: int, seed: int = 0, bias: bool = True) -> L.Linear:
    torch.manual_seed(seed)
    lin = L.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3.0, n)[:, None])  # channels of different ranges
    return lin


def test_weight_quantization_is_per_output_channel():
    w = torch.randn(24, 40) * torch.linspace(0.01, 10, 24)[:, None]
    q, s = quantize_weight(w, "int8")
    assert q.dtype is torch.int8 and s.shape == (24,)
    assert int(q.abs().amax(dim=1).min()) == 127  # every row uses its full range
    err = (dequantize_weight(q, s, torch.float32) - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())  # half a step per channel
    qf, sf = quantize_weight(w, "fp8")
    assert qf.dtype is torch.float8_e4m3fn
    assert torch.allclose(qf.float().abs().amax(dim=1), torch.full((24,), FP8_MAX))
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 of each element (normal range)
    big = w.abs() > sf[:, None] * 2**-6
    rel = ((dequantize_weight(qf, sf, torch.float32) - w).abs() / w.abs())[big]
    assert float(rel.max()) <= 2**-4 + 1e-6


def test_activation_quantization_is_per_token():
    x = torch.randn(5, 32) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 7.0])[:, None]
    q, s = quantize_activations(x, "int8")
    assert q.dtype is torch.int8 and s.shape == (5, 1)
    assert int(q[3].abs().max()) == 0  # an all-zero token quantizes to zeros (no NaN)
    assert [int(v) for v in q.abs().amax(dim=1)] == [127, 127, 127, 0, 127]


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_few_row_and_many_row_activation_paths_agree(fmt):
    """A few rows take fewer ops for the row maximum: the same values as the two-reduction path
    (rows quantized alone or among many give identical bytes and scales)."""
    from oasr.quantization import numerics

    x = torch.randn(600, 384, generator=torch.Generator().manual_seed(3)) * 3
    assert x[:2].numel() <= numerics._FEW < x.numel()
    many_q, many_s = quantize_activations(x, fmt)
    few_q, few_s = quantize_activations(x[:2], fmt)
    assert torch.equal(few_s, many_s[:2])
    assert torch.equal(few_q.view(torch.int8), many_q[:2].view(torch.int8))


@pytest.mark.parametrize("method,bound", [("int8_w8a8", 1e-5), ("fp8_w8a8", 1e-5)])
@pytest.mark.parametrize("smoothed", [False, True])
def test_cpu_gemm_matches_float64_reference(method, bound, smoothed):
    """CPU int8 (torch._int_mm, int32 accumulation) and CPU fp8 (torch._scaled_mm) against the
    float64 reference of the same quantized weights: the only differences are float32 scaling
    and the rounding of a value on a quantization boundary, so the bound is tight."""
    lin = _linear(64, 48)
    scale = torch.rand(64) + 0.5 if smoothed else None
    q = QuantizedLinear.from_linear(lin, method, input_scale=scale)
    x = torch.randn(3, 7, 64) * 2
    got = q(x)
    ref = reference_linear(x, q.weight_q, q.weight_scale, q.bias, q.fmt, q.input_scale)
    assert got.shape == (3, 7, 48) and got.dtype is torch.float32
    assert rel_err(got, ref) < bound
    # float64 inputs take the reference path itself
    assert torch.equal(q(x.double()), ref)
    # and the quantized layer stays close to the float layer it came from
    assert rel_err(got, lin(x)) < (0.02 if method == "int8_w8a8" else 0.08)


def test_fallback_matches_reference(caplog):
    """The path for shapes the fused GEMMs refuse (K or N not a multiple of 16 for fp8): the
    same quantized values multiplied in float32, logged once per layer."""
    lin = _linear(40, 20)  # 40, 20: not multiples of 16
    q = QuantizedLinear.from_linear(lin, "fp8_w8a8")
    x = torch.randn(4, 40)
    with caplog.at_level(logging.INFO, logger="oasr.layers.quantized"):
        got = q(x)
        q(x)
    assert sum("float32 matmul" in r.message for r in caplog.records) == 1
    ref = reference_linear(x, q.weight_q, q.weight_scale, q.bias, q.fmt)
    assert rel_err(got, ref) < 1e-5


def test_module_dtype_moves_keep_scales_and_weights():
    q = QuantizedLinear.from_linear(_linear(32, 16), "fp8_w8a8")
    before = q.weight_scale.clone()
    q.half()
    assert q.qweight.dtype is torch.uint8 and q.weight_scale.dtype is torch.float32
    assert torch.equal(q.weight_scale, before) and q.compute_dtype is torch.float16
    assert q.bias.dtype is torch.float16 and q.weight.dtype is torch.float16
    y = q(torch.randn(2, 32, dtype=torch.float16))
    assert y.dtype is torch.float16


def test_weight_property_undoes_smoothing():
    lin = _linear(32, 16)
    q = QuantizedLinear.from_linear(lin, "int8_w8a8", input_scale=torch.rand(32) * 4 + 0.25)
    step = (q.weight_scale[:, None] / q.input_scale[None, :]).max()
    assert float((q.weight - lin.weight).abs().max()) <= float(step) / 2 + 1e-6


@pytest.mark.parametrize("onednn", [True, False])
def test_both_cpu_int8_gemms_match_reference(monkeypatch, onednn):
    """The CPU's int8 GEMM is oneDNN's int8 linear where it works (checked once against exact
    integer products), else torch._int_mm: both give the reference's values."""
    from oasr.layers import quantized

    if onednn and not quantized._onednn_int8_works():
        pytest.skip("oneDNN's int8 linear is not usable in this torch / CPU")
    monkeypatch.setattr(quantized, "_ONEDNN_INT8", [onednn])
    lin = _linear(96, 40, seed=3)
    q = QuantizedLinear.from_linear(lin, "int8_w8a8")
    for rows in (1, 5, 300):
        x = torch.randn(rows, 96)
        ref = reference_linear(x, q.weight_q, q.weight_scale, q.bias, q.fmt)
        assert rel_err(q(x), ref) < 1e-5


@pytest.mark.parametrize("onednn", [True, False])
def test_two_term_activations_match_reference(monkeypatch, onednn):
    """``act_terms=2`` (the tied output projection's activations): both CPU int8 GEMMs and the
    dequantized fallback against the float64 reference of the same two-term math, 1e-5."""
    from oasr.layers import quantized as qmod
    from oasr.quantization.numerics import quantize_activation_terms

    if onednn and not qmod._onednn_int8_works():
        pytest.skip("oneDNN's int8 linear is not usable in this torch / CPU")
    monkeypatch.setattr(qmod, "_ONEDNN_INT8", [onednn])
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 64, generator=g)
    q = qmod.QuantizedLinear.from_weight(w, torch.randn(200, generator=g), "int8_w8a8", act_terms=2)
    for rows in (1, 7, 40):
        x = torch.randn(rows, 64, generator=g) * 3
        want = q(x.double())
        for got in (q(x), q._dequantized(x, "test")):
            assert rel_err(got, want) < 1e-5
        stacked, scales = quantize_activation_terms(x, "int8", 2)
        assert stacked.shape == (2 * rows, 64) and scales.shape == (2 * rows, 1)
        # the second term is the first's rounding error, at most half a step of the first
        assert bool((scales[rows:] * 127 <= scales[:rows] / 2 * (1 + 1e-6)).all())
    with pytest.raises(ValueError, match="act_terms"):
        qmod.QuantizedLinear(8, 8, "fp8_w8a8", act_terms=2)

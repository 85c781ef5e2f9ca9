"""The CPU int8 GEMM without VNNI (``_int_mm_cpu``'s float32 path): the same integer products as
``torch._int_mm``, so a CPU int8 layer gives bit-identical outputs either way."""

from __future__ import annotations

import pytest
import torch

from oasr.layers import quantized as Q
from oasr.layers.quantized import QuantizedLinear
from oasr.quantization.numerics import quantize_weight


@pytest.fixture
def gemm_path():
    """Set which CPU int8 GEMM runs (True: float32 chunks, False: torch._int_mm); restored after."""
    saved = list(Q._INT_MM_SLOW)

    def use(float32: bool) -> None:
        Q._INT_MM_SLOW[:] = [float32]

    yield use
    Q._INT_MM_SLOW[:] = saved


def _layer(k: int, n: int, seed: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    qw, scale = quantize_weight(w, "int8")
    bias = torch.randn(n, generator=g)
    return QuantizedLinear.from_quantized(qw, scale, bias, "int8_w8a8", dtype=torch.float32)


@pytest.mark.parametrize("m,k,n", [(9, 384, 96), (40, 1536, 64), (3, 2500, 48)])
def test_float32_chunks_equal_int_mm(gemm_path, m, k, n):
    """Extreme int8 values (every product +-128 * 127) and K past one exact chunk (1536, 2500:
    two and three chunks) give exactly torch._int_mm's int32 products."""
    g = torch.Generator().manual_seed(k)
    xq = torch.randint(-128, 128, (m, k), generator=g, dtype=torch.int8)
    xq[0].fill_(-128)
    layer = _layer(k, n, seed=m)
    layer.qweight[0].fill_(-127)  # row 0 x column 0: the largest sum, 128 * 127 * K
    gemm_path(True)
    got = Q._int_mm_cpu(layer, xq)
    want = torch._int_mm(xq, layer.qweight.t().contiguous())
    assert torch.equal(got.to(torch.float32), want.to(torch.float32))
    assert int(want[0, 0]) == 128 * 127 * k


def test_layer_outputs_bit_identical(gemm_path):
    """A whole quantized layer (one- and two-term activations, bias) on both GEMM paths."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(17, 1536, generator=g) * 3
    for terms in (1, 2):
        layer = _layer(1536, 80, seed=terms)
        layer.act_terms = terms
        gemm_path(False)
        want = layer(x)
        gemm_path(True)
        layer._kn = None
        got = layer(x)
        assert torch.equal(got, want)


def test_forced_by_environment(monkeypatch):
    monkeypatch.setenv("OASR_INT8_FLOAT32_GEMM", "1")
    assert Q._int_mm_is_slow() is True
    monkeypatch.setenv("OASR_INT8_FLOAT32_GEMM", "0")
    assert Q._int_mm_is_slow() is False


@pytest.mark.parametrize("terms", [1, 2])
def test_float_held_activations_are_the_int8_values(terms):
    """``as_float``: the same integers and scales as the int8 activations, held in float32 (the
    float32-matmul GEMM's input)."""
    from oasr.quantization.numerics import quantize_activation_terms

    x = torch.randn(33, 384, generator=torch.Generator().manual_seed(terms)) * 5
    xq, sx = quantize_activation_terms(x, "int8", terms)
    xf, sf = quantize_activation_terms(x, "int8", terms, as_float=True)
    assert xq.dtype == torch.int8 and xf.dtype == torch.float32
    assert torch.equal(xf, xq.to(torch.float32)) and torch.equal(sf, sx)


def test_layer_uses_float_held_activations_on_the_float32_path(gemm_path, monkeypatch):
    """Where the float32 matmuls are the int8 GEMM (and oneDNN's int8 linear is not used), the
    layer hands them float32 activations; its outputs stay those of torch._int_mm."""
    monkeypatch.setattr(Q, "_ONEDNN_INT8", [False])
    seen = []
    real = Q._int_mm_cpu

    def spy(module, xq):
        seen.append(xq.dtype)
        return real(module, xq)

    monkeypatch.setattr(Q, "_int_mm_cpu", spy)
    x = torch.randn(20, 384, generator=torch.Generator().manual_seed(5))
    layer = _layer(384, 72, seed=5)
    gemm_path(False)
    want = layer(x)
    gemm_path(True)
    got = layer(x)
    assert seen == [torch.int8, torch.float32]
    assert torch.equal(got, want)

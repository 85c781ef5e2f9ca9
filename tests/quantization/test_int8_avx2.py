"""The CPU int8 GEMM through FBGEMM's AVX2 kernels with 7-bit per-token activations
(oasr.layers.int8_avx2): exact integer products on the worst case for its 16-bit pair sums, and
whole layers against the float64 reference of the same math (``act_qmax=64``)."""

from __future__ import annotations

import pytest
import torch

from oasr.layers import int8_avx2 as A
from oasr.layers import quantized as Q
from oasr.layers.quantized import QuantizedLinear
from oasr.quantization.numerics import AVX2_ACT_QMAX, quantize_activation_terms, reference_linear


def _fbgemm_or_skip() -> None:
    try:
        A._gemm(torch.zeros(1, 8), A._prepack(torch.zeros(8, 8, dtype=torch.int8), torch.ones(8)))
    except (AttributeError, RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch's FBGEMM int8 linear is not usable here ({exc})")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.double().abs().max())


@pytest.mark.parametrize("m,k,n", [(1, 384, 40), (9, 1536, 64), (300, 384, 48)])
def test_products_exact_at_the_saturation_worst_case(m, k, n):
    """Every activation at +-64 against weights at +-127 (pair sums 2 * 128 * 127 in the 16-bit
    lanes): the integer products, scaled by the per-channel weight scale, equal int64 math."""
    _fbgemm_or_skip()
    g = torch.Generator().manual_seed(m + k)
    q = int(AVX2_ACT_QMAX)
    x = torch.randint(-q, q + 1, (m, k), generator=g).float()
    x[0] = torch.where(torch.randn(k, generator=g) > 0, q, -q)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w[0] = torch.where(x[0] > 0, 127, -127).to(torch.int8)  # row 0 x column 0: 64 * 127 * K
    scale = torch.rand(n, generator=g) + 0.5
    got = A._gemm(x, A._prepack(w, scale))
    want = (x.long() @ w.long().t()).double() * scale.double()
    assert float(want[0, 0]) == pytest.approx(64 * 127 * k * float(scale[0]))
    assert _rel(got, want) < 1e-6


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("rows", [1, 7, 120])
def test_layer_matches_float64_reference(terms, rows):
    """A whole layer (bias; one or two activation terms) on this path against
    ``reference_linear(..., act_qmax=64)``: float32 scaling only, 1e-5; two terms 5e-5 (the
    residual is float32 here, float64 there: a second-term value on a rounding boundary moves
    by one of its steps, 2x the 8-bit path's, which measured 1.4e-5 at 120 rows)."""
    _fbgemm_or_skip()
    g = torch.Generator().manual_seed(rows * terms)
    w = torch.randn(96, 384, generator=g)
    q = QuantizedLinear.from_weight(w, torch.randn(96, generator=g), "int8_w8a8", act_terms=terms)
    x = torch.randn(rows, 384, generator=g) * 3
    got = A.avx2_int8_linear(q, x)
    want = reference_linear(x, q.weight_q, q.weight_scale, q.bias, "int8", act_terms=terms,
                            act_qmax=AVX2_ACT_QMAX)  # fmt: skip
    assert got.dtype is torch.float32 and _rel(got, want) < (1e-5 if terms == 1 else 5e-5)
    xq, _ = quantize_activation_terms(x, "int8", terms, AVX2_ACT_QMAX)
    assert int(xq.abs().max()) <= AVX2_ACT_QMAX
    if terms == 1:
        # the cost of 7 bits, bounded: each activation within half a step (max |x_row| / 64) of
        # its value, so |y7 - y8| <= (step7 + step8) / 2 * sum_k |W[n, k]| per row and column
        eight = reference_linear(x, q.weight_q, q.weight_scale, q.bias, "int8")
        amax = x.double().abs().amax(dim=1, keepdim=True)
        half_steps = (amax / AVX2_ACT_QMAX + amax / 127) / 2
        w_abs = (q.weight_q.double().abs() * q.weight_scale.double()[:, None]).sum(dim=1)
        assert bool(((want - eight).abs() <= half_steps * w_abs[None, :] * (1 + 1e-9)).all())


def test_weight_change_repacks():
    _fbgemm_or_skip()
    g = torch.Generator().manual_seed(0)
    q = QuantizedLinear.from_weight(torch.randn(16, 64, generator=g), None, "int8_w8a8")
    x = torch.randn(3, 64, generator=g)
    before = A.avx2_int8_linear(q, x)
    q.qweight.neg_()
    after = A.avx2_int8_linear(q, x)
    assert _rel(after, -before) < 1e-6


def test_chosen_only_without_int8_dot(monkeypatch):
    """Used only on an x86 CPU without VNNI / AVX-VNNI / AMX, and not when disabled."""
    monkeypatch.setattr(Q, "_NO_INT8_DOT", [False])
    assert A._check() is False
    monkeypatch.setattr(Q, "_NO_INT8_DOT", [True])
    monkeypatch.setenv("OASR_INT8_AVX2_FBGEMM", "0")
    assert A._check() is False
    monkeypatch.delenv("OASR_INT8_AVX2_FBGEMM")
    _fbgemm_or_skip()
    assert A._check() is True


def test_background_packing_matches_inline(monkeypatch):
    """Without VNNI / AMX, ``prepack_in_background`` makes FBGEMM's packed weights of the
    two-term layers only (none for oneDNN), the forward pass then uses what it made, and the
    outputs equal a layer packed inline; nothing is packed where FBGEMM is switched off."""
    _fbgemm_or_skip()
    monkeypatch.setattr(Q, "_NO_INT8_DOT", [True])
    monkeypatch.setattr(A, "_APPLIES", [])
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(200, 64, generator=g), torch.randn(200, generator=g)
    one = QuantizedLinear.from_weight(w, b, "int8_w8a8")
    two = QuantizedLinear.from_weight(w, b, "int8_w8a8", act_terms=2)
    inline = QuantizedLinear.from_weight(w, b, "int8_w8a8", act_terms=2)
    assert Q.prepack_in_background([one]) is None  # no two-term layer: nothing to pack
    thread = Q.prepack_in_background([one, two])
    assert thread is not None
    thread.join(30)
    packed = two._fbgemm_packed[1]
    assert getattr(one, "_fbgemm_packed", None) is None and one._onednn is None
    x = torch.randn(5, 64, generator=g)
    got = A.avx2_int8_linear(two, x)
    assert two._fbgemm_packed[1] is packed  # made once, by the thread
    assert torch.equal(got, A.avx2_int8_linear(inline, x))

    monkeypatch.setattr(A, "_APPLIES", [])
    monkeypatch.setenv("OASR_INT8_AVX2_FBGEMM", "0")
    off = QuantizedLinear.from_weight(w, b, "int8_w8a8", act_terms=2)
    thread = Q.prepack_in_background([off])
    if thread is not None:
        thread.join(30)
    assert getattr(off, "_fbgemm_packed", None) is None

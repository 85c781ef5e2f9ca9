"""The quantized math, in one place: what a quantized linear computes and its float64 reference.

Symmetric quantization everywhere (no zero points):

* weights (N, K): one scale per output channel, ``s_w[n] = max_k |W[n, k]| / QMAX``,
  ``W_q = round(W / s_w)`` (int8: clamped to [-127, 127]; fp8: cast to e4m3 with its own
  rounding, |W / s_w| <= 448);
* activations (M, K): one scale per token (row), computed on the fly from that row,
  ``s_x[m] = max_k |x[m, k]| / QMAX``, ``x_q = round(x / s_x)``;
* ``y = (x_q W_q^T) * s_x * s_w^T + b``: the integer (or fp8) products summed exactly (int32
  accumulation; fp8 products accumulate in float32), then scaled in float32.

An optional per-input-channel ``input_scale`` (SmoothQuant) divides ``x`` before it is quantized;
the weight was multiplied by it before its quantization, so ``(x / s) (W s)^T = x W^T``.

Scales are float32. :func:`reference_linear` computes the same thing in float64 from the same
quantized weight ("fake quantization"): the parity tests compare every GEMM path with it.
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_DTYPE",
    "dequantize_kv",
    "quantize_kv",
    "FP8_MAX",
    "INT8_MAX",
    "dequantize_weight",
    "quantize_activation_terms",
    "quantize_activations",
    "quantize_weight",
    "reference_dense_linear",
    "reference_linear",
]

INT8_MAX = 127.0
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
#: the smallest scale: an all-zero row quantizes to zeros instead of dividing by zero
_TINY = 1e-12
#: inputs up to this many elements take the fewer-ops row maximum (quantize_activations)
_FEW = 16384
#: elements per block of rows in quantize_weight on the CPU (256 KiB of float32)
_WEIGHT_BLOCK = 65536


def _absmax(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``max |x|`` along ``dim`` (kept), as max(max x, -min x): two vectorised reductions and no
    temporary the size of ``x`` (on CPU ~10x faster than ``vector_norm(x, inf)``, ~1.3x than
    ``x.abs().amax()``)."""
    return torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg_())


#: int8 activations' largest magnitude on FBGEMM's AVX2 path (an x86 CPU without VNNI / AMX):
#: with zero point 64 they are bytes 0..128, and its 16-bit pair sums (``vpmaddubsw``) stay
#: within 2 * 128 * 127 = 32512 < 2**15, so its integer products are exact (7-bit activations)
AVX2_ACT_QMAX = 64


def qmax(fmt: str) -> float:
    return INT8_MAX if fmt == "int8" else FP8_MAX


def quantize_weight(weight: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_q (N, K) int8 or float8_e4m3fn, s_w (N,) float32)`` for a float weight (N, K)."""
    w = weight.detach()
    n = w.shape[0]
    q = torch.empty(w.shape, dtype=torch.int8 if fmt == "int8" else FP8_DTYPE, device=w.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    # blocks of rows that stay in the CPU's cache through the four passes (each row is quantized
    # on its own: the same values as one pass over the whole matrix). It matters at load time: a
    # tied output projection is a 51 864-row table (80 MB in float32)
    step = max(1, _WEIGHT_BLOCK // max(1, w.shape[1])) if w.device.type == "cpu" else n
    for r in range(0, n, step):
        wb = w[r : r + step].float()
        sb = torch.div(_absmax(wb, 1), qmax(fmt), out=scale[r : r + step]).clamp_min_(_TINY)
        # |W / s_w| <= QMAX by construction (as quantize_activations): no clamp pass
        scaled = torch.div(wb, sb)
        q[r : r + step] = scaled.round_() if fmt == "int8" else scaled
    return q, scale.squeeze(1)


def dequantize_weight(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W_q * s_w`` as ``dtype`` (N, K)."""
    return (qweight.to(torch.float32) * scale.float()[:, None]).to(dtype)


def quantize_activations(
    x: torch.Tensor, fmt: str, act_qmax: float | None = None, as_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x_q (M, K), s_x (M, 1) float32)``: per-token dynamic quantization of a 2-D input
    (``act_qmax``: the largest magnitude of an int8 value, default 127; 64 on an AVX2 CPU's FBGEMM
    path, :data:`AVX2_ACT_QMAX`). ``as_float`` (int8 only): ``x_q``'s integers held in float32,
    for a GEMM that takes float32 operands (the CPU's float32-matmul int8 path), which saves
    the int8 copy and its conversion back. The
    scale and the division are float32 whatever the input's dtype (fp16 rows quantize the same
    on CPU and GPU). Few passes over ``x``: this runs before every quantized GEMM (on CUDA five
    kernels: the row maxima, two on the (M, 1) scales, the division, the cast)."""
    q = act_qmax or qmax(fmt)
    if x.is_cuda:
        # one reduction kernel; the fp16/bf16 -> float32 promotion happens inside the division
        amax = torch.linalg.vector_norm(x, float("inf"), dim=1, keepdim=True, dtype=torch.float32)
        scale = amax.div_(q).clamp_min_(_TINY)
        scaled = torch.div(x, scale)
    else:
        xf = x.float()
        # a few rows (decode steps): two ops (abs, amax) instead of four; each op's dispatch
        # costs more than its pass there. The values are the same either way (max |x| is exact)
        amax = xf.abs().amax(dim=1, keepdim=True) if xf.numel() <= _FEW else _absmax(xf, 1)
        scale = amax.div_(q).clamp_min_(_TINY)
        scaled = torch.div(xf, scale)
    # |x / s| <= QMAX by construction (s = max|x| / QMAX, float32 rounding included: 127.00002
    # rounds to 127, 448.0001 to e4m3's 448): no clamp pass
    if fmt == "int8":
        rounded = scaled.round_()
        return (rounded if as_float else rounded.to(torch.int8)), scale
    return scaled.to(FP8_DTYPE), scale


def quantize_activation_terms(
    x: torch.Tensor, fmt: str, terms: int = 1, act_qmax: float | None = None, as_float: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_activations` with ``terms`` int8 terms per row: for 2, the rounding error
    of the first, ``r = x - s1 q1`` (float32), quantized per token the same way, so that
    ``x ~ s1 q1 + s2 q2`` (about 14 bits per element instead of 8). Returns the terms stacked
    (``terms * M``, K) and their scales (``terms * M``, 1): a GEMM over the stack reads the weight
    once, and output rows ``m`` and ``M + m`` add up to row ``m``. ``as_float``: as in
    :func:`quantize_activations`."""
    xq, sx = quantize_activations(x, fmt, act_qmax, as_float)
    if terms == 1:
        return xq, sx
    rest = x.float() - xq.float() * sx
    rq, rs = quantize_activations(rest, fmt, act_qmax, as_float)
    return torch.cat([xq, rq]), torch.cat([sx, rs])


def reference_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    fmt: str,
    input_scale: torch.Tensor | None = None,
    act_terms: int = 1,
    act_qmax: float | None = None,
) -> torch.Tensor:
    """The quantized linear in float64 (fake quantization): activations quantized per token
    (int8 values of magnitude at most ``act_qmax``, default 127) with scales computed in
    float64 (``act_terms`` 2: the rounding error quantized again, as
    :func:`quantize_activation_terms`), products of the quantized values summed in float64
    (exact for int8), scaled in float64. ``x`` (..., K) -> (..., N) float64."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).double()
    if input_scale is not None:
        x2 = x2 / input_scale.double()
    q = (act_qmax or qmax(fmt)) if fmt == "int8" else qmax(fmt)
    wq = qweight.double()
    y = torch.zeros(x2.shape[0], wq.shape[0], dtype=torch.float64, device=x2.device)
    for _ in range(act_terms):
        sx = (x2.abs().amax(dim=1, keepdim=True) / q).clamp_min(_TINY)
        if fmt == "int8":
            xq = (x2 / sx).round().clamp(-q, q)
        else:
            xq = (x2 / sx).clamp(-q, q).to(FP8_DTYPE).double()
        y = y + (xq @ wq.t()) * sx * weight_scale.double()[None, :]
        x2 = x2 - xq * sx
    if bias is not None:
        y = y + bias.double()
    return y.reshape(*shape[:-1], wq.shape[0])


def reference_dense_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A quantized layer's dense path (``QuantizedLinear.keep_dense_weight``) in float64: the
    quantized weight dequantized (smoothing undone), the activations unquantized,
    ``x (W_q s_w / input_scale)^T + b``. ``x`` (..., K) -> (..., N) float64."""
    w = qweight.double() * weight_scale.double()[:, None]
    if input_scale is not None:
        w = w / input_scale.double()[None, :]
    y = x.double() @ w.t()
    return y if bias is None else y + bias.double()


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 KV cache's format: ``x`` (N, heads, head_dim) -> (e4m3 bytes as uint8 (N, heads,
    head_dim), float32 scales (N, heads)), one scale per key/value vector (its max / 448)."""
    if x.is_cuda:  # one reduction kernel (see quantize_activations)
        amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, dtype=torch.float32)
        xf = x
    else:
        xf = x.float()
        amax = _absmax(xf, -1).squeeze(-1)
    scale = amax.div_(FP8_MAX).clamp_min_(_TINY)
    q = torch.div(xf, scale[..., None]).to(FP8_DTYPE)  # |x / s| <= 448: no clamp pass
    return q.view(torch.uint8), scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize_kv`: (..., heads, head_dim) uint8 bytes and (..., heads)
    scales -> ``dtype`` values."""
    return (q.view(FP8_DTYPE).to(torch.float32) * scale[..., None]).to(dtype)

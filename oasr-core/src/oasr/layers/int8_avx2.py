"""CPU int8 GEMM on an x86 CPU without an int8 dot-product instruction (no AVX-512 VNNI,
AVX-VNNI or AMX-INT8; e.g. an AVX2 EPYC): FBGEMM's AVX2 kernels, through torch's x86
quantized linear (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``).

Those kernels multiply unsigned activation bytes by signed weight bytes in pairs summed into a
saturating 16-bit lane (``vpmaddubsw``): 8-bit activations saturate there (torch's own dynamic
quantization uses 7 bits on such CPUs, ``reduce_range``). This path keeps OASR's per-token
symmetric activations, with 7-bit values: magnitudes at most
:data:`~oasr.quantization.numerics.AVX2_ACT_QMAX` (64), entered as bytes ``q + 64`` (0..128)
with input scale 1 and zero point 64, so every pair sum is at most 2 * 128 * 127 = 32512 and the
integer products are exact (FBGEMM subtracts the zero point's term in int32). The per-channel
weight scales are applied inside, the per-token scales after: the float64 reference is
``reference_linear(..., act_qmax=64)``, within 1e-5 x max |y| (tests/quantization/test_int8_avx2.py).

QuantizedLinear uses it for two-term layers only (Whisper's tied output projection: about 13
bits per activation; one 7-bit term in every linear cost tiny.en 1.7 WER points). Only where
:func:`oasr.layers.quantized._x86_without_int8_dot` holds and a one-time check of
exact products passes; ``OASR_INT8_AVX2_FBGEMM=0`` keeps the float32 matmuls of the 8-bit
values (:func:`oasr.layers.quantized._int_mm_cpu`).
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch

from oasr.quantization.numerics import AVX2_ACT_QMAX, quantize_activation_terms

log = logging.getLogger(__name__)

__all__ = ["avx2_int8_linear", "fbgemm_int8_applies", "fbgemm_packed"]

#: whether this path is used here (decided once)
_APPLIES: list[bool] = []


def fbgemm_int8_applies() -> bool:
    """Whether CPU int8 linears here run through FBGEMM with 7-bit activations (module
    docstring): an x86 CPU without VNNI / AMX, torch's FBGEMM linear present, and its products
    exact on a worst case (checked once against int64)."""
    if not _APPLIES:
        _APPLIES.append(_check())
    return _APPLIES[0]


def _check() -> bool:
    from oasr.layers.quantized import _x86_without_int8_dot

    forced = os.environ.get("OASR_INT8_AVX2_FBGEMM")
    if forced == "0" or not _x86_without_int8_dot():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        q = int(AVX2_ACT_QMAX)
        x = torch.randint(-q, q + 1, (5, 256), generator=g).float()
        x[0].fill_(q)
        x[1].fill_(-q)
        w = torch.randint(-127, 128, (24, 256), generator=g, dtype=torch.int8)
        w[:12].fill_(127)
        w[12:].fill_(-127)  # the largest pair sums, both signs
        scale = torch.rand(24, generator=g) + 0.5
        packed = _prepack(w, scale)
        got = _gemm(x, packed)
        want = (x.long() @ w.long().t()).double() * scale.double()
        ok = bool(((got.double() - want).abs() <= 1e-6 * want.abs().max()).all())
    except (AttributeError, RuntimeError, TypeError, NotImplementedError) as exc:
        log.info("FBGEMM int8 linear unavailable (%s: %s); int8 GEMMs run as float32 matmuls",
                 type(exc).__name__, exc)  # fmt: skip
        return False
    if ok:
        log.info("no VNNI / AMX on this CPU: int8 linears run through FBGEMM's AVX2 kernels with "
                 "7-bit per-token activations")  # fmt: skip
    else:
        log.info(
            "FBGEMM int8 linear gives inexact products here; int8 GEMMs run as float32 matmuls"
        )
    return ok


def _prepack(qweight: torch.Tensor, weight_scale: torch.Tensor) -> Any:
    n = qweight.shape[0]
    with warnings.catch_warnings():  # torch's quantized tensors are deprecated, still present
        warnings.simplefilter("ignore")
        wq = torch._make_per_channel_quantized_tensor(
            qweight, weight_scale.double(), torch.zeros(n, dtype=torch.long), 0
        )
        return torch.ops.quantized.linear_prepack(wq, None)


def _gemm(xq_float: torch.Tensor, packed: Any) -> torch.Tensor:
    """``(x_q W_q^T) * s_w`` in float32 for integer-valued float activations of magnitude <= 64."""
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
        xq_float, 1.0, int(AVX2_ACT_QMAX), packed
    )


def fbgemm_packed(module: Any) -> Any:
    """FBGEMM's packed form of ``module``'s int8 weight (remade when the weight or its scales
    change). A :func:`oasr.layers.quantized.prepack_in_background` thread may be making it: one
    lock per layer, so it is packed once."""
    from oasr.layers.quantized import _pack_lock

    key = (module.qweight._version, module.qweight.data_ptr(), module.weight_scale._version)
    got = getattr(module, "_fbgemm_packed", None)
    if got is not None and got[0] == key:
        return got[1]
    with _pack_lock(module):
        got = getattr(module, "_fbgemm_packed", None)
        if got is None or got[0] != key:
            got = (key, _prepack(module.qweight, module.weight_scale))
            module._fbgemm_packed = got
    return got[1]


def avx2_int8_linear(module: Any, x2: torch.Tensor) -> torch.Tensor:
    """A :class:`~oasr.layers.quantized.QuantizedLinear` (int8, CPU) on a 2-D input through
    FBGEMM: 7-bit per-token activations (``act_terms`` of them), bias added, in ``x2``'s dtype."""
    m = x2.shape[0]
    xq, sx = quantize_activation_terms(x2, "int8", module.act_terms, AVX2_ACT_QMAX)
    y = _gemm(xq.to(torch.float32), fbgemm_packed(module)).mul_(sx)
    if module.act_terms == 2:
        y = y[:m].add_(y[m:])
    if module.bias is not None:
        y = y.add_(module.bias)
    return y.to(x2.dtype)

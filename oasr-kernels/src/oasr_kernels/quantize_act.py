"""CUDA override of ``oasr.layers.quantized``'s ``quantize_activations`` op (``csrc/quantize_act.cu``).

Every W8A8 linear on the GPU quantizes its input per token first. The native op is five
launches (row maxima, two on the scales, the division into a float32 copy of ``x``, the cast);
this kernel is one: a block per row reads it twice (the maximum, then the quantized values) and
writes only the bytes and the scale. The same float32 operations as the native op, so the same
bytes and scales (tests/quantization/test_fused_quant_gpu.py checks it). fp32 / fp16 / bf16
contiguous 2-D inputs; anything else, or no compiler, falls back to the native op.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = ["quantize_activations_cuda"]

MODULE = KernelModule("quantize_act.cu")
_QMAX = {"fp8": 448.0, "int8": 127.0}
_MAX_THREADS = 256


def quantize_activations_cuda(x: torch.Tensor, fmt: str) -> Any:
    """``(x_q (M, K), s_x (M, 1) float32)`` as :func:`oasr.quantization.numerics.
    quantize_activations` returns them (fp8: float8_e4m3fn, int8: int8), or ``NotImplemented``."""
    if (not x.is_cuda or x.dim() != 2 or x.dtype not in DTYPE_TAGS or fmt not in _QMAX
            or not x.is_contiguous() or x.shape[0] > 2**31 - 1 or x.shape[1] == 0):  # fmt: skip
        return NotImplemented
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        per_vec = 16 // x.element_size()
        units = k // per_vec if (k % per_vec == 0 and x.data_ptr() % 16 == 0) else k
        threads = min(_MAX_THREADS, max(32, -(-units // 32) * 32))
        # torch divides by the Python scalar as a multiply by its float32 reciprocal
        inv = np.float32(1.0) / np.float32(_QMAX[fmt])
        args = (
            np.uint64(x.data_ptr()),
            np.uint64(q.data_ptr()),
            np.uint64(scale.data_ptr()),
            np.int32(k),
            inv,
        )
        name = f"oasr_quantize_act_{fmt}_{DTYPE_TAGS[x.dtype]}"
        if not MODULE.launch(name, (m,), (threads,), args, x.device):
            return NotImplemented
    return (q.view(torch.float8_e4m3fn) if fmt == "fp8" else q.view(torch.int8)), scale

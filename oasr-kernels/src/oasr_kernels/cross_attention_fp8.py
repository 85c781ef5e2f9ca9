"""CUDA override of ``oasr.layers.quantized.cross_attention_fp8`` (the fp8 cross-attention K/V of
the autoregressive executor; ``csrc/cross_attention_fp8.cu``).

A decode step's cross-attention reads every frame of every row in every layer (Whisper large-v3,
64 rows: 1500 frames x 1280 values per layer for K and again for V); this kernel reads them as
e4m3 bytes and one float32 scale per (frame, head) straight from the pools, half the bytes of
fp16, instead of dequantizing them first (the native op). One query per (row, head) (a decode
step: ``q`` (B, H, 1, D)), fp32 / fp16 / bf16 queries, head size 64 or 128, grouped key/value
heads; other inputs (the prefill's several queries) fall back to the native op. Compiled on
first use like every oasr-kernels module (:class:`oasr_kernels.jit.KernelModule`); capturable
in CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import DTYPE_TAGS, KernelModule
from oasr_kernels.paged_attention_fp8 import HEAD_DIMS, decode_query_fp8_reason

__all__ = ["HEAD_DIMS", "UNROLL", "cross_attention_fp8_cuda", "unsupported_reason"]

MODULE = KernelModule("cross_attention_fp8.cu")
_THREADS = 128
_WARPS = _THREADS // 32
_SMEM_LIMIT = 48 * 1024
#: loads in flight per lane: 2 (at most 48 registers, 10 blocks per SM: large-v3's 64 rows x 20
#: heads all resident on an H200) or 4 (more bytes in flight per block, 7-8 blocks per SM)
UNROLLS = (2, 4)
UNROLL = 2


def smem_bytes(frames: int, head_dim: int) -> int:
    # float part[W * D], red_max[W], red_sum[W], scores[S]
    return 4 * (_WARPS * head_dim + 2 * _WARPS + frames)


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor) -> str | None:  # fmt: skip
    """Why the kernel cannot take these inputs (None if it can)."""
    reason = decode_query_fp8_reason(q, k, v, "k and v")
    if reason is not None:
        return reason
    b, h, _, d = q.shape
    if k.dim() != 4 or k.shape[0] != b or k.shape[3] != d or v.shape != k.shape:
        return "k and v must both be (B, H_kv, S, D)"
    if k_scale.dtype != torch.float32 or k_scale.shape != k.shape[:3] or v_scale.shape != k_scale.shape:
        return "scales must be float32 (B, H_kv, S)"
    hkv, frames = k.shape[1], k.shape[2]
    if hkv < 1 or h % hkv:
        return f"{h} query heads cannot share {hkv} key/value heads"
    if frames < 1 or smem_bytes(frames, d) > _SMEM_LIMIT:
        return f"{frames} frames"
    if not all(t.is_contiguous() for t in (k, v, k_scale, v_scale)):
        return "k, v and their scales must be contiguous"
    if k.data_ptr() % 16 or v.data_ptr() % 16:
        return "k and v must be 16-byte aligned"
    if len({t.device for t in (q, k, v, k_scale, v_scale)}) != 1:
        return "tensors on different devices"
    if b > 65535:
        return "more than 65535 rows"
    return None


def cross_attention_fp8_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                             v_scale: torch.Tensor, scale: float | None = None) -> Any:  # fmt: skip
    """Override of ``cross_attention_fp8`` on "cuda"; ``NotImplemented`` (native) for inputs it
    does not handle or when the module cannot be compiled here."""
    if unsupported_reason(q, k, v, k_scale, v_scale) is not None:
        return NotImplemented
    b, h, _, d = q.shape
    out = torch.empty((b, h, 1, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    frames = k.shape[2]
    args = (
        np.uint64(q.data_ptr()), np.int64(q.stride(0)), np.int64(q.stride(1)),
        np.uint64(k.data_ptr()), np.uint64(v.data_ptr()),
        np.uint64(k_scale.data_ptr()), np.uint64(v_scale.data_ptr()), np.uint64(out.data_ptr()),
        np.int32(h), np.int32(k.shape[1]), np.int32(frames),
        np.float32(d**-0.5 if scale is None else scale),
    )  # fmt: skip
    name = f"oasr_cross_attention_fp8_{DTYPE_TAGS[q.dtype]}_d{d}_u{UNROLL}"
    if not MODULE.launch(name, (h, b), (_THREADS,), args, q.device, shared_mem=smem_bytes(frames, d)):
        return NotImplemented
    return out

"""CUDA override of ``oasr.layers.quantized.paged_decode_attention_fp8`` (the fp8 KV cache's
decode attention; ``csrc/paged_decode_attention_fp8.cu``).

The kernel reads each row's valid keys and values straight from the fp8 pools (one byte per
element, one float32 scale per key/value vector) and decodes e4m3 with integer operations, so
the cache is read once at a byte per element, instead of dequantizing the rows' blocks to fp16
first (the native op). fp32 / fp16 / bf16 queries, head size 64 or 128, grouped key/value heads;
other inputs fall back to the native op. Compiled on first use like every oasr-kernels module
(:class:`oasr_kernels.jit.KernelModule`); capturable in CUDA graphs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = ["HEAD_DIMS", "decode_query_fp8_reason", "paged_decode_attention_fp8_cuda", "unsupported_reason"]

MODULE = KernelModule("paged_decode_attention_fp8.cu")
HEAD_DIMS = (64, 128)
_THREADS = 128
_WARPS = _THREADS // 32
_SMEM_LIMIT = 48 * 1024


def smem_bytes(nb: int, block_size: int, head_dim: int) -> int:
    # long long tbl[nb]; float part[W * D], red_max[W], red_sum[W], scores[nb * block_size]
    return nb * 8 + 4 * (_WARPS * head_dim + 2 * _WARPS + nb * block_size)


def decode_query_fp8_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, what: str) -> str | None:
    """The checks every fp8 decode-attention kernel makes of its query and its key/value bytes
    (``what`` names those in the message): one CUDA query per (row, head), a supported head size,
    e4m3 bytes stored as uint8."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dim() != 4 or q.shape[2] != 1 or q.dtype not in DTYPE_TAGS:
        return "q must be (B, H, 1, D) fp32/fp16/bf16"
    if q.shape[3] not in HEAD_DIMS:
        return f"head size {q.shape[3]} (supported: {HEAD_DIMS})"
    if k.dtype != torch.uint8 or v.dtype != torch.uint8:
        return f"{what} must hold e4m3 bytes (uint8)"
    return None


def unsupported_reason(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, k_scale: torch.Tensor,
                       v_scale: torch.Tensor, block_tables: torch.Tensor,
                       lengths: torch.Tensor) -> str | None:  # fmt: skip
    """Why the kernel cannot take these inputs (None if it can)."""
    reason = decode_query_fp8_reason(q, k_pool, v_pool, "pools")
    if reason is not None:
        return reason
    b, h, _, d = q.shape
    if k_pool.dim() != 4 or k_pool.shape[3] != d or v_pool.shape != k_pool.shape:
        return "pools must both be (num_blocks, block_size, H_kv, D)"
    if k_scale.dtype != torch.float32 or k_scale.shape != k_pool.shape[:3] or v_scale.shape != k_scale.shape:
        return "scales must be float32 (num_blocks, block_size, H_kv)"
    hkv = k_pool.shape[2]
    if hkv < 1 or h % hkv:
        return f"{h} query heads cannot share {hkv} key/value heads"
    if not all(t.is_contiguous() for t in (k_pool, v_pool, k_scale, v_scale)):
        return "pools and scales must be contiguous"
    if k_pool.data_ptr() % 8 or v_pool.data_ptr() % 8:
        return "pools must be 8-byte aligned"
    if block_tables.dtype != torch.int64 or lengths.dtype != torch.int64:
        return "block_tables and lengths must be int64"
    if block_tables.dim() != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
        return "block_tables must be (B, nb) and lengths (B,)"
    if len({t.device for t in (q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths)}) != 1:
        return "tensors on different devices"
    nb, bs = block_tables.shape[1], k_pool.shape[1]
    if nb < 1 or smem_bytes(nb, bs, d) > _SMEM_LIMIT:
        return f"{nb} blocks x {bs} keys per row"
    if b > 65535:
        return "more than 65535 rows"
    return None


def paged_decode_attention_fp8_cuda(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                    k_scale: torch.Tensor, v_scale: torch.Tensor,
                                    block_tables: torch.Tensor, lengths: torch.Tensor,
                                    scale: float | None = None) -> Any:  # fmt: skip
    """Override of ``paged_decode_attention_fp8`` on "cuda"; ``NotImplemented`` (native) for
    inputs it does not handle or when the module cannot be compiled here."""
    if unsupported_reason(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths) is not None:
        return NotImplemented
    b, h, _, d = q.shape
    out = torch.empty((b, h, 1, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    block_tables = block_tables.contiguous()
    lengths = lengths.contiguous()
    nb, bs = block_tables.shape[1], k_pool.shape[1]
    args = (
        np.uint64(q.data_ptr()), np.int64(q.stride(0)), np.int64(q.stride(1)),
        np.uint64(k_pool.data_ptr()), np.uint64(v_pool.data_ptr()),
        np.uint64(k_scale.data_ptr()), np.uint64(v_scale.data_ptr()),
        np.uint64(block_tables.data_ptr()), np.uint64(lengths.data_ptr()), np.uint64(out.data_ptr()),
        np.int32(h), np.int32(k_pool.shape[2]), np.int32(nb), np.int32(bs),
        np.float32(d**-0.5 if scale is None else scale),
    )  # fmt: skip
    name = f"oasr_paged_decode_attention_fp8_{DTYPE_TAGS[q.dtype]}_d{d}"
    if not MODULE.launch(name, (h, b), (_THREADS,), args, q.device, shared_mem=smem_bytes(nb, bs, d)):
        return NotImplemented
    return out

"""CUDA override of ``oasr.layers.paged_prefill_attention`` (``csrc/paged_prefill_attention.cu``).

A flash-style kernel: each thread block takes a tile of queries of one (row, head), walks the
row's keys straight from the paged pools in tiles of 32 (no gather copy, no dense mask), keeps an
online softmax in fp32 and stops at its last query's position (causal). fp32 / fp16 / bf16,
head size 64 or 128, grouped key/value heads; other inputs fall back to the native op.
Warps per block (4 queries each) come from the autotune cache (:func:`oasr.tune.tuned_params`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr.tune import Tunable, tuned_params
from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = ["HEAD_DIMS", "MAX_TOKENS", "TUNABLES", "launch", "paged_prefill_attention_cuda", "unsupported_reason"]

MODULE = KernelModule("paged_prefill_attention.cu")
HEAD_DIMS = (64, 128)
_KEY_TILE = 32
_QUERIES_PER_WARP = 4
_SMEM_LIMIT = 48 * 1024
#: longest block of new tokens the override takes: the kernel computes with fp32 FMAs, so for
#: long prompts PyTorch's tensor-core attention over the gathered keys wins (the kernel's place
#: is the short prompts of speech decoders: Whisper's 3-4 start tokens, many rows at once)
MAX_TOKENS = 64


def smem_bytes(nb: int, head_dim: int, warps: int) -> int:
    # long long tbl[nb]; float qs[QB * D], ks[KT * (D + 1)], vs[KT * (D + 1)]
    qb = warps * _QUERIES_PER_WARP
    return nb * 8 + 4 * (qb * head_dim + 2 * _KEY_TILE * (head_dim + 1))


def unsupported_reason(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       block_tables: torch.Tensor, lengths: torch.Tensor) -> str | None:  # fmt: skip
    """Why the kernel cannot take these inputs (None if it can)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dim() != 4 or q.dtype not in DTYPE_TAGS:
        return "q must be (B, H, T, D) fp32/fp16/bf16"
    b, h, t, d = q.shape
    if d not in HEAD_DIMS:
        return f"head size {d} (supported: {HEAD_DIMS})"
    if q.stride(-1) != 1:
        return "q's last axis must be contiguous"
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return "q, k_pool and v_pool dtypes differ"
    if k_pool.dim() != 4 or k_pool.shape[3] != d or v_pool.shape != k_pool.shape:
        return "pools must both be (num_blocks, block_size, H_kv, D)"
    if k_pool.shape[2] < 1 or h % k_pool.shape[2]:
        return f"{h} query heads cannot share {k_pool.shape[2]} key/value heads"
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        return "pools must be contiguous"
    if block_tables.dtype != torch.int64 or lengths.dtype != torch.int64:
        return "block_tables and lengths must be int64"
    if block_tables.dim() != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
        return "block_tables must be (B, nb) and lengths (B,)"
    if len({t_.device for t_ in (q, k_pool, v_pool, block_tables, lengths)}) != 1:
        return "tensors on different devices"
    nb = block_tables.shape[1]
    if nb < 1 or smem_bytes(nb, d, 1) > _SMEM_LIMIT:
        return f"{nb} blocks per row"
    if b > 65535 or h > 65535 or t < 1:
        return "shape out of range"
    return None


def _default(d: int) -> dict[str, int]:
    return {"warps": 4}


def key(dtype: torch.dtype, d: int) -> str:
    return f"{DTYPE_TAGS[dtype]}:d{d}"


def launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
           lengths: torch.Tensor, scale: float | None,
           params: dict[str, int] | None = None) -> torch.Tensor | None:  # fmt: skip
    b, h, t, d = q.shape
    nb, bs, hkv = block_tables.shape[1], k_pool.shape[1], k_pool.shape[2]
    if params is None:
        params = tuned_params("paged_prefill_attention", key(q.dtype, d), q.device, _default(d))
    warps = int(params["warps"])
    while warps > 1 and smem_bytes(nb, d, warps) > _SMEM_LIMIT:
        warps //= 2
    out = torch.empty((b, h, t, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_tables = block_tables.contiguous()
    lengths = lengths.contiguous()
    scale = float(d**-0.5 if scale is None else scale)
    args = (
        np.uint64(q.data_ptr()), np.int64(q.stride(0)), np.int64(q.stride(1)), np.int64(q.stride(2)),
        np.uint64(k_pool.data_ptr()), np.uint64(v_pool.data_ptr()),
        np.uint64(block_tables.data_ptr()), np.uint64(lengths.data_ptr()), np.uint64(out.data_ptr()),
        np.int32(t), np.int32(h), np.int32(hkv), np.int32(nb), np.int32(bs), np.float32(scale),
    )  # fmt: skip
    qb = warps * _QUERIES_PER_WARP
    grid = (-(-t // qb), h, b)
    name = f"oasr_paged_prefill_attention_{DTYPE_TAGS[q.dtype]}_d{d}"
    if not MODULE.launch(name, grid, (32 * warps,), args, q.device, shared_mem=smem_bytes(nb, d, warps)):
        return None
    return out


def paged_prefill_attention_cuda(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                                 block_tables: torch.Tensor, lengths: torch.Tensor,
                                 scale: float | None = None) -> Any:  # fmt: skip
    """Override of ``paged_prefill_attention`` on "cuda" (blocks of up to :data:`MAX_TOKENS`
    new tokens)."""
    if q.dim() == 4 and q.shape[2] > MAX_TOKENS:
        return NotImplemented
    if unsupported_reason(q, k_pool, v_pool, block_tables, lengths) is not None:
        return NotImplemented
    d = q.shape[3]
    tuned = tuned_params("paged_prefill_attention", key(q.dtype, d), q.device, _default(d))
    if not tuned.get("use_kernel", True):
        return NotImplemented
    out = launch(q, k_pool, v_pool, block_tables, lengths, scale, tuned)
    return NotImplemented if out is None else out


def _tuning_inputs(shape: dict, dtype: torch.dtype, device: torch.device) -> tuple:
    """Random (q, k_pool, v_pool, block_tables, lengths) of a tuning shape, blocks shuffled."""
    b, h, t, d, bs = (int(shape[n]) for n in ("batch", "heads", "tokens", "head_dim", "block_size"))
    nb = -(-t // bs)
    q = torch.randn(b, h, t, d, device=device, dtype=dtype)
    k = torch.randn(b * nb, bs, h, d, device=device, dtype=dtype)
    v = torch.randn_like(k)
    tables = torch.randperm(b * nb, device=device).view(b, nb)
    lengths = torch.full((b,), t, dtype=torch.long, device=device)
    return q, k, v, tables, lengths


def _make(shape: dict, dtype: torch.dtype, device: torch.device):
    q, k, v, tables, lengths = _tuning_inputs(shape, dtype, device)
    return lambda p: launch(q, k, v, tables, lengths, None, p)


def _native(shape: dict, dtype: torch.dtype, device: torch.device):
    import oasr.layers as L

    q, k, v, tables, lengths = _tuning_inputs(shape, dtype, device)

    def run():
        with L.native_ops():
            return L.paged_prefill_attention(q, k, v, tables, lengths)

    return run


TUNABLES = [
    Tunable(
        op="paged_prefill_attention",
        key=lambda shape, dtype: key(dtype, int(shape["head_dim"])),
        candidates=lambda shape: [{"warps": w} for w in (1, 2, 4, 8)],
        make=_make,
        default=lambda shape: _default(int(shape["head_dim"])),
        # the override takes up to MAX_TOKENS new tokens: tune at Whisper's prompt lengths
        shapes=[{"batch": 64, "heads": 20, "tokens": 4, "head_dim": 64, "block_size": 16},
                {"batch": 8, "heads": 28, "tokens": 32, "head_dim": 128, "block_size": 16}],  # fmt: skip
        native=_native,
    )
]

"""CUDA overrides of two ``oasr.layers.llm`` ops of decoder-only language models
(``csrc/llm_ops.cu``), each one pass where the native op makes several over strided views:

* ``rotary_qk``: rotary positions on the queries and keys of a fused q/k/v projection, q and k
  written contiguous. Natively four kernels (multiply, concatenate, multiply, add) and a copy of
  the keys; at a 7B decoder's prefill (32 x 770 tokens, 64 heads of 128) each moves about
  0.8 GB through torch's non-vectorised strided path. Each product and the sum are rounded as
  the native ops round them: the output is the native one bit for bit.
* ``silu_mul``: ``silu(gate) * up`` of a fused gate/up projection (natively two kernels over
  the two strided halves), rounded after the SiLU as the native op rounds."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = ["MODULE", "rotary_qk_cuda", "silu_mul_cuda"]

MODULE = KernelModule("llm_ops.cu")
_THREADS = 256
#: (head, j) pairs per rotary_qk block: 256 threads, a pair each (two heads of D = 256, four of 128)
_ROTARY_GROUP_PAIRS = 256
#: 16-byte units (8 pairs at 16 bits) per block of the vectorised rotary_qk: 128 threads, a unit
#: each (16 heads of D = 128): a 7B decode step's 32 tokens x 64 heads make 128 blocks
_ROTARY_VEC_UNITS = 128


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def rotary_qk_cuda(
    qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int
) -> Any:
    """Override of ``rotary_qk`` on "cuda": (q (B, T, heads, D), k (B, T, kv_heads * D)), both
    contiguous; ``NotImplemented`` (the native op runs) for inputs it does not take."""
    if not qk.is_cuda or qk.dtype not in DTYPE_TAGS or qk.dim() != 4 or qk.stride(-1) != 1:
        return NotImplemented
    b, t, n, d = qk.shape
    if d % 2 or not 0 < heads < n:
        return NotImplemented
    tables = []
    for c in (cos, signed_sin):
        if c.dtype != qk.dtype or c.device != qk.device or c.dim() != 4 or c.shape[2:] != (1, d):
            return NotImplemented
        if c.shape[0] not in (1, b) or c.shape[1] not in (1, t) or c.stride(-1) != 1:
            return NotImplemented
        c = c.expand(b, t, 1, d)  # broadcast axes read with stride 0
        tables.append(c)
    cos, signed_sin = tables
    q = torch.empty((b, t, heads, d), dtype=qk.dtype, device=qk.device)
    k = torch.empty((b, t, (n - heads) * d), dtype=qk.dtype, device=qk.device)
    if b * t == 0:
        return q, k
    if b * t > 2**31 - 1:
        return NotImplemented
    # a block per (token, group of pairs): enough blocks for a decode step. Vectorised: each
    # thread takes per_vec neighbouring pairs as 16-byte vectors, where every row starts aligned
    per_vec = 16 // qk.element_size()
    vec = (d // 2) % per_vec == 0 and all(
        t_.data_ptr() % 16 == 0 and all(st % per_vec == 0 for st in t_.stride()[:-1])
        for t_ in (qk, cos, signed_sin)
    )
    units = n * d // 2 // (per_vec if vec else 1)
    group = _ROTARY_VEC_UNITS if vec else _ROTARY_GROUP_PAIRS
    threads = min(_THREADS, -(-min(units, group) // 32) * 32)
    groups = -(-units // group)
    if groups > 65535:
        return NotImplemented
    args = (_ptr(qk), np.int64(qk.stride(0)), np.int64(qk.stride(1)), np.int64(qk.stride(2)),
            _ptr(cos), np.int64(cos.stride(0)), np.int64(cos.stride(1)),
            _ptr(signed_sin), np.int64(signed_sin.stride(0)), np.int64(signed_sin.stride(1)),
            _ptr(q), _ptr(k), np.int32(t), np.int32(heads), np.int32(n - heads), np.int32(d),
            np.int32(group))  # fmt: skip
    name = f"oasr_rotary_qk_{DTYPE_TAGS[qk.dtype]}{'_v' if vec else ''}"
    if not MODULE.launch(name, (b * t, groups), (threads,), args, qk.device):
        return NotImplemented
    return q, k


def silu_mul_cuda(x: torch.Tensor, hidden: int) -> Any:
    """Override of ``silu_mul`` on "cuda": ``silu(x[..., :hidden]) * x[..., hidden:]`` for a
    contiguous ``x`` (..., 2 * hidden); ``NotImplemented`` for inputs it does not take."""
    if not x.is_cuda or x.dtype not in DTYPE_TAGS or x.dim() < 1 or not x.is_contiguous():
        return NotImplemented
    if hidden < 1 or x.shape[-1] != 2 * hidden:
        return NotImplemented
    out = torch.empty((*x.shape[:-1], hidden), dtype=x.dtype, device=x.device)
    rows = x.numel() // x.shape[-1]
    if rows == 0:
        return out
    if rows > 2**31 - 1:
        return NotImplemented
    per_vec = 16 // x.element_size()
    vec = hidden % per_vec == 0 and x.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    units = hidden // per_vec if vec else hidden
    threads = min(_THREADS, -(-units // 32) * 32)
    # a block per (row, chunk of one element or vector per thread): a decode step's few rows
    # still give the GPU a few hundred blocks, each with one round of loads in flight
    chunk = threads * (per_vec if vec else 1)
    chunks = -(-hidden // chunk)
    name = f"oasr_silu_mul_{DTYPE_TAGS[x.dtype]}{'_v' if vec else ''}"
    args = (_ptr(x), _ptr(out), np.int32(hidden), np.int32(chunk))
    if not MODULE.launch(name, (rows, chunks), (threads,), args, x.device):
        return NotImplemented
    return out

"""CUDA override of ``oasr.layers.quantized``'s ``quantize_activations`` op (``csrc/quantize_act.cu``).

Every W8A8 linear on the GPU quantizes its input per token first. The native op is five
launches (row maxima, two on the scales, the division into a float32 copy of ``x``, the cast);
this kernel is one: a group of threads per row (a warp when the rows fill the GPU, up to a thread
per 16-byte vector for a decode step's few) holds the row in registers from the maximum to the
quantized values, so ``x`` is read once and only the bytes and the scale are written. The same
float32 operations as the native op, so the same bytes and scales
(tests/quantization/test_fused_quant_gpu.py checks it). fp32 / fp16 / bf16 contiguous 2-D
inputs; anything else, or no compiler, falls back to the native op.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import DTYPE_TAGS, KernelModule

__all__ = ["dequantize_kv_cuda", "quantize_activations_cuda", "quantize_kv_into_cuda"]

MODULE = KernelModule("quantize_act.cu")
_QMAX = {"fp8": 448.0, "int8": 127.0}
#: vectors (16 bytes) per thread the kernels can hold in registers: csrc/quantize_act.cu's
#: oasr_quantize_act_*_vV kernels (V = 0: the row read twice, for any row)
_VECS = (1, 2, 3, 4, 6, 8, 12, 16)
#: threads per block when a row's group is smaller (several rows per block)
_BLOCK = 256
_MAX_GROUP = 1024


@functools.cache
def _fill_threads(device_index: int | None) -> int:
    """Threads that fill the GPU (2048 per multiprocessor; an H200's 132 without one)."""
    if device_index is None:
        return 132 * 2048
    return torch.cuda.get_device_properties(device_index).multi_processor_count * 2048


def plan(rows: int, units: int, vec: bool, fill: int) -> tuple[int, int]:
    """``(group, V)``: the threads per row (a multiple of 32) and the vectors each holds (0: the
    kernel that reads the row twice) for ``rows`` rows of ``units`` 16-byte vectors (``vec``) or
    elements. The smallest group whose rows fill the GPU (``fill`` threads), each thread holding
    at most 16 vectors (4 in a 1024-thread group); fewer rows take larger groups, down to a vector
    per thread (a decode step's latency)."""
    whole = min(_MAX_GROUP, -(-units // 32) * 32)  # a thread per unit, at most a block
    choice = None
    g = 32
    while True:
        group = min(g, whole)
        need = -(-units // group)
        held = next((v for v in _VECS if v >= need), None) if vec else 0
        if held is not None and group > 512 and held > 4:
            held = None  # a 1024-thread block has 64 registers a thread: at most 4 vectors held
        if held is not None:
            choice = (group, held)
            if rows * group >= fill:
                break
        if group == whole:
            break
        g *= 2
    return choice or (whole, 0)


def quantize_activations_cuda(x: torch.Tensor, fmt: str) -> Any:
    """``(x_q (M, K), s_x (M, 1) float32)`` as :func:`oasr.quantization.numerics.
    quantize_activations` returns them (fp8: float8_e4m3fn, int8: int8), or ``NotImplemented``."""
    if (not x.is_cuda or x.dim() != 2 or x.dtype not in DTYPE_TAGS or fmt not in _QMAX
            or not x.is_contiguous() or x.shape[0] > 2**31 - 1 or x.shape[1] == 0
            or x.shape[1] > 2**31 - 1):  # fmt: skip
        return NotImplemented
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.uint8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m:
        per_vec = 16 // x.element_size()
        vec = k % per_vec == 0 and x.data_ptr() % 16 == 0
        fill = _fill_threads(x.device.index if x.device.type == "cuda" else None)
        group, held = plan(m, k // per_vec if vec else k, vec, fill)
        rows_per_block = max(1, _BLOCK // group)
        threads = group * rows_per_block
        # torch divides by the Python scalar as a multiply by its float32 reciprocal
        inv = np.float32(1.0) / np.float32(_QMAX[fmt])
        args = (
            np.uint64(x.data_ptr()),
            np.uint64(q.data_ptr()),
            np.uint64(scale.data_ptr()),
            np.int32(m),
            np.int32(k),
            np.int32(group),
            inv,
            np.int32(vec),
        )
        name = f"oasr_quantize_act_{fmt}_{DTYPE_TAGS[x.dtype]}_v{held}"
        smem = 4 * (threads // 32) if group > 32 else 0  # a float per warp: the groups' maxima
        grid = (-(-m // rows_per_block),)
        if not MODULE.launch(name, grid, (threads,), args, x.device, shared_mem=smem):
            return NotImplemented
    return (q.view(torch.float8_e4m3fn) if fmt == "fp8" else q.view(torch.int8)), scale


_KV_THREADS = 256
#: blocks at most per KV launch (the kernels loop): enough to fill any GPU many times over
_KV_MAX_BLOCKS = 16384


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def quantize_kv_into_cuda(x: torch.Tensor, q_out: torch.Tensor, s_out: torch.Tensor,
                          index: torch.Tensor | None = None) -> Any:  # fmt: skip
    """:func:`oasr.layers.quantized.quantize_kv_into` in one launch: ``x`` (R, I, H, D) fp32 /
    fp16 / bf16 with a contiguous last axis, ``q_out`` (R', I, H, D) uint8 and ``s_out`` (R', I, H)
    float32 with any strides (``q_out``'s last axis contiguous), ``index`` (R,) int64 rows of the
    outputs (None: R' == R, row r). Returns None, or ``NotImplemented`` for other inputs."""
    if (x.dim() != 4 or q_out.dim() != 4 or s_out.dim() != 3 or x.dtype not in DTYPE_TAGS
            or q_out.dtype != torch.uint8 or s_out.dtype != torch.float32 or x.stride(-1) != 1
            or q_out.stride(-1) != 1 or not (x.is_cuda and q_out.is_cuda and s_out.is_cuda)):  # fmt: skip
        return NotImplemented
    rows, inner, heads, d = x.shape
    if q_out.shape[1:] != x.shape[1:] or s_out.shape != q_out.shape[:3]:
        return NotImplemented
    if index is None:
        if q_out.shape[0] != rows:
            return NotImplemented
        index_ptr = 0
    else:
        if index.dtype != torch.long or index.shape != (rows,) or not index.is_cuda:
            return NotImplemented
        index = index.contiguous()
        index_ptr = index.data_ptr()
    total = rows * inner * heads
    if total == 0 or d == 0:
        return None
    if max(rows, inner, heads, d) > 2**31 - 1:
        return NotImplemented
    n = 16 // x.element_size()
    esize = x.element_size()
    # whole 16-byte loads of x and n-byte stores of q: every vector's start aligned
    vec = (d % n == 0 and x.data_ptr() % 16 == 0 and all(st * esize % 16 == 0 for st in x.stride()[:3])
           and q_out.data_ptr() % n == 0 and all(st % n == 0 for st in q_out.stride()[:3]))  # fmt: skip
    group = min(32, _pow2_at_least(-(-d // n) if vec else d))
    blocks = min(_KV_MAX_BLOCKS, -(-total * group // _KV_THREADS))
    xs, qs, ss = x.stride(), q_out.stride(), s_out.stride()
    args = (
        np.uint64(x.data_ptr()),
        np.uint64(q_out.data_ptr()),
        np.uint64(s_out.data_ptr()),
        np.uint64(index_ptr),
        np.int32(rows),
        np.int32(inner),
        np.int32(heads),
        np.int32(d),
        *(np.int64(v) for v in (xs[0], xs[1], xs[2], qs[0], qs[1], qs[2], ss[0], ss[1], ss[2])),
        np.int32(group),
        np.int32(vec),
        np.float32(1.0) / np.float32(_QMAX["fp8"]),
    )
    name = f"oasr_quantize_kv_{DTYPE_TAGS[x.dtype]}"
    if not MODULE.launch(name, (blocks,), (_KV_THREADS,), args, x.device):
        return NotImplemented
    return None


def dequantize_kv_cuda(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Any:
    """:func:`oasr.quantization.numerics.dequantize_kv` in one launch (contiguous ``q`` (..., H, D)
    uint8 and ``scale`` (..., H) float32; fp32 / fp16 / bf16 out): the same values as the native
    ops (an exact e4m3 decode, one float32 multiply, one rounding). ``NotImplemented`` otherwise."""
    if (not q.is_cuda or q.dtype != torch.uint8 or scale.dtype != torch.float32 or dtype not in DTYPE_TAGS
            or q.dim() < 1 or scale.shape != q.shape[:-1] or not q.is_contiguous()
            or not scale.is_contiguous()):  # fmt: skip
        return NotImplemented
    d = q.shape[-1]
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    n = scale.numel()
    if n == 0 or d == 0:
        return out
    vec = d % 8 == 0 and q.data_ptr() % 8 == 0
    work = n * (d // 8) if vec else n * d
    blocks = min(_KV_MAX_BLOCKS, -(-work // _KV_THREADS))
    args = (
        np.uint64(q.data_ptr()),
        np.uint64(scale.data_ptr()),
        np.uint64(out.data_ptr()),
        np.int64(n),
        np.int32(d),
        np.int32(vec),
    )
    name = f"oasr_dequantize_kv_{DTYPE_TAGS[dtype]}"
    if not MODULE.launch(name, (blocks,), (_KV_THREADS,), args, q.device):
        return NotImplemented
    return out

"""CUDA override of ``oasr.layers.paged_decode_attention``.

The kernel (``csrc/paged_decode_attention.cu``) reads each row's valid keys straight from the
paged pools: no gather copy, no padding to a power-of-two block count, one launch per layer.
It is compiled by NVRTC through CuPy on the first call (all six variants in one module: fp32,
fp16, bf16 x head size 64, 128). CuPy caches the compiled binary on disk per GPU architecture
and compiler version (``~/.cupy/kernel_cache``, ``CUPY_CACHE_DIR``), so later processes only
load it.

The launch goes onto torch's current stream with raw ``data_ptr()`` pointers, the output is
allocated by torch, and nothing reads back to the host: the call can be captured in a CUDA
graph (``torch.cuda.graph``) and replayed with new lengths and block tables written in place.
The first call must happen outside capture (compiling and loading a module is not capturable);
a first call inside a capture falls back to the native op.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from oasr_kernels.jit import read_source, torch_stream

__all__ = [
    "HEAD_DIMS", "MAX_KEYS", "launch_config", "paged_decode_attention_cuda", "unsupported_reason",
]  # fmt: skip

log = logging.getLogger(__name__)

HEAD_DIMS = (64, 128)
#: most keys one row may address (nb * block_size): the scores live in shared memory
MAX_KEYS = 8192
_THREADS = 128  # kThreads in the .cu
_WARPS = _THREADS // 32
_SMEM_LIMIT = 48 * 1024  # the default dynamic shared memory limit, no opt-in attribute needed
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_module: Any = None
_kernels: dict[tuple[str, int, int], Any] = {}  # (dtype tag, head dim, device index) -> RawKernel
_disabled: list[str] = []  # why the kernel was turned off for this process (compile failure)
_warned_capture: list[bool] = []
_local = threading.local()  # .ready: kernels this thread has launched outside graph capture


def _smem_bytes(nb: int, block_size: int, head_dim: int) -> int:
    # long long tbl[nb]; float part[W * D], red_max[W], red_sum[W], scores[nb * block_size]
    return nb * 8 + 4 * (_WARPS * head_dim + 2 * _WARPS + nb * block_size)


def unsupported_reason(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                       block_tables: torch.Tensor, lengths: torch.Tensor) -> str | None:  # fmt: skip
    """Why the kernel cannot take these inputs (None if it can)."""
    if not q.is_cuda:
        return "not a CUDA tensor"
    if q.dim() != 4 or q.shape[2] != 1:
        return "q must be (B, H, 1, D)"
    b, h, _, d = q.shape
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype}"
    if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
        return "q, k_pool and v_pool dtypes differ"
    if d not in HEAD_DIMS:
        return f"head size {d} (supported: {HEAD_DIMS})"
    if k_pool.dim() != 4 or k_pool.shape[3] != d or v_pool.shape != k_pool.shape:
        return "pools must both be (num_blocks, block_size, H_kv, D)"
    if k_pool.shape[2] < 1 or h % k_pool.shape[2]:
        return f"{h} query heads cannot share {k_pool.shape[2]} key/value heads"
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        return "pools must be contiguous"
    if k_pool.data_ptr() % 16 or v_pool.data_ptr() % 16:
        return "pools must be 16-byte aligned"
    if block_tables.dtype != torch.int64 or lengths.dtype != torch.int64:
        return "block_tables and lengths must be int64"
    if block_tables.dim() != 2 or block_tables.shape[0] != b or lengths.shape != (b,):
        return "block_tables must be (B, nb) and lengths (B,)"
    devices = {t.device for t in (q, k_pool, v_pool, block_tables, lengths)}
    if len(devices) != 1:
        return "tensors on different devices"
    nb, bs = block_tables.shape[1], k_pool.shape[1]
    if nb < 1 or nb * bs > MAX_KEYS or _smem_bytes(nb, bs, d) > _SMEM_LIMIT:
        return f"{nb} blocks x {bs} keys (at most {MAX_KEYS} keys per row)"
    if b > 65535:
        return "more than 65535 rows"
    return None


def _source() -> str:
    # common.cuh first, as every KernelModule source: the block softmax lives there
    return read_source("paged_decode_attention.cu")


def _kernel(tag: str, head_dim: int, device_index: int) -> Any:
    key = (tag, head_dim, device_index)
    kernel = _kernels.get(key)
    if kernel is not None:
        return kernel
    global _module
    with _lock:
        import cupy

        if _module is None:
            _module = cupy.RawModule(code=_source(), options=("-std=c++17",))
        # get_function compiles (or reads the disk cache) and loads for the current device
        kernel = _module.get_function(f"oasr_paged_decode_attention_{tag}_d{head_dim}")
        kernel.kernel  # noqa: B018 - older CuPy versions load on first use: load it now
        _kernels[key] = kernel
    return kernel


def launch_config(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  block_tables: torch.Tensor, lengths: torch.Tensor, out: torch.Tensor,
                  scale: float | None) -> tuple[str, tuple, tuple, tuple, int]:  # fmt: skip
    """Kernel name, grid, block, arguments (in the kernel's parameter order and C types) and
    dynamic shared memory bytes for one launch. Needs q.stride(-1) == 1 and contiguous tables,
    lengths and out; touches no GPU, so tests can run it against an emulation of the kernel."""
    import numpy as np

    b, h, _, d = q.shape
    nb, bs = block_tables.shape[1], k_pool.shape[1]
    scale = float(d**-0.5 if scale is None else scale)
    args = (
        np.uint64(q.data_ptr()), np.int64(q.stride(0)), np.int64(q.stride(1)),
        np.uint64(k_pool.data_ptr()), np.uint64(v_pool.data_ptr()),
        np.uint64(block_tables.data_ptr()), np.uint64(lengths.data_ptr()),
        np.uint64(out.data_ptr()),
        np.int32(h), np.int32(k_pool.shape[2]), np.int32(nb), np.int32(bs), np.float32(scale),
    )  # fmt: skip
    name = f"oasr_paged_decode_attention_{_DTYPES[q.dtype]}_d{d}"
    return name, (h, b), (_THREADS,), args, _smem_bytes(nb, bs, d)


def paged_decode_attention_cuda(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Override of the ``paged_decode_attention`` op on "cuda"; ``NotImplemented`` (native
    fallback) for inputs it does not handle."""
    if _disabled or unsupported_reason(q, k_pool, v_pool, block_tables, lengths) is not None:
        return NotImplemented

    b, h, _, d = q.shape
    device = q.device
    key = (_DTYPES[q.dtype], d, device.index)
    ready = getattr(_local, "ready", None)
    if ready is None:
        ready = _local.ready = set()
    first = key not in ready
    if first and torch.cuda.is_current_stream_capturing():
        # Loading the module (and CuPy's per-thread context set-up) cannot be captured.
        if not _warned_capture:
            _warned_capture.append(True)
            log.warning("oasr-kernels: first paged_decode_attention call of this thread is "
                        "inside CUDA graph capture; using the native op there (run the step "
                        "once eagerly before capturing)")  # fmt: skip
        return NotImplemented
    out = torch.empty((b, h, 1, d), dtype=q.dtype, device=device)
    if b == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()  # q is tiny; the pools are never copied
    block_tables = block_tables.contiguous()
    lengths = lengths.contiguous()
    _, grid, block, args, smem = launch_config(q, k_pool, v_pool, block_tables, lengths, out, scale)
    # Asynchronous: no host synchronisation, nothing read back, so the launch is capturable.
    try:
        if device.index == torch.cuda.current_device():
            _kernel(*key)(grid, block, args, shared_mem=smem, stream=torch_stream(device))
        else:  # CuPy compiles, loads and launches on its current device
            with torch.cuda.device(device):
                _kernel(*key)(grid, block, args, shared_mem=smem, stream=torch_stream(device))
    except Exception as exc:  # noqa: BLE001 - never stop inference for a kernel
        if not first:
            raise  # it ran before: a real launch failure, not a missing compiler
        _disabled.append(f"{type(exc).__name__}: {exc}")
        log.warning("oasr-kernels: paged decode attention kernel unavailable (%s: %s); "
                    "using the native op", type(exc).__name__, exc)  # fmt: skip
        return NotImplemented
    if first:
        ready.add(key)
    return out

"""CUDA override of the CTC prefix beam search's frame loop (``oasr.decoders.ctc_gpu``, op
``ctc_prefix_beam_frames``): every frame of a chunk in one launch, one warp per batch row
(``csrc/ctc_prefix_beam.cu``), instead of ~130 small tensor kernels per frame.

The kernel restates the tensor implementation step by step in float64 (the same candidates,
merges, first-touch tie keys and selection), so the n-best, scores and times are the same; the
tensor implementation stays the reference (``OASR_DISABLE_OVERRIDES=1`` turns this off).
Until it has been checked on a device by the GPU tests it runs only when ``OASR_CTC_KERNEL=1``;
otherwise, and when it cannot run (no CuPy, a compile failure, beam above 64), the override
returns ``NotImplemented`` and the tensor path runs. Launches go on torch's current stream and
read nothing back.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from oasr_kernels.jit import KernelModule

__all__ = ["KERNEL", "MAX_BEAM", "ctc_prefix_beam_frames_cuda", "kernel_arguments"]

MODULE = KernelModule("ctc_prefix_beam.cu")
KERNEL = "oasr_ctc_prefix_beam"
MAX_BEAM = 64
LANES = 32  # OASR_CTC_LANES in the .cu: threads per row (one block each)


def enabled() -> bool:
    return os.environ.get("OASR_CTC_KERNEL", "0") in ("1", "true", "yes")


def kernel_arguments(c: Any, tv: torch.Tensor, ti: torch.Tensor, f: torch.Tensor, i: torch.Tensor,
                     valid: torch.Tensor, frame0: torch.Tensor, lens_t: torch.Tensor, ctx: Any,
                     tok_par: torch.Tensor, node_lp: torch.Tensor
                     ) -> tuple[list[tuple[str, Any]], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:  # fmt: skip
    """The kernel's arguments in order as ``(kind, value)`` (``i32``, ``i64``, ``ptr``: a
    tensor), and the state tensors it updates in place (F, I, valid as uint8). Shared by the
    CUDA launch and the host-compiled test of the same source."""
    bsz, t_max, k = ti.shape
    w = c.w
    n_cand = w + w * k
    dev = tv.device
    f = f.contiguous().clone()
    i = i.contiguous().clone()
    v = valid.contiguous().clone().view(torch.uint8)
    tv = tv.to(torch.float64).contiguous()
    ti = ti.to(torch.int64).contiguous()
    scratch = (torch.empty((bsz, n_cand, 7), dtype=torch.float64, device=dev),
               torch.empty((bsz, n_cand, 8), dtype=torch.int64, device=dev),
               torch.empty((bsz, n_cand), dtype=torch.uint8, device=dev),
               torch.empty((bsz, w * k), dtype=torch.uint8, device=dev),
               torch.empty((bsz, w, 2), dtype=torch.float64, device=dev),
               torch.empty((bsz, w), dtype=torch.int64, device=dev),
               torch.empty((bsz, LANES), dtype=torch.float64, device=dev),
               torch.empty((bsz, LANES, 2), dtype=torch.int64, device=dev))
    if ctx is not None and ctx.keys.numel():
        tables = (ctx.keys, ctx.next, ctx.bonus, ctx.node_score, ctx.root)
        has_ctx, vocab, nkeys = 1, ctx.vocab, ctx.keys.numel()
    else:
        one_i = torch.zeros(1, dtype=torch.int64, device=dev)
        one_f = torch.zeros(1, dtype=torch.float64, device=dev)
        tables = (one_i, one_i, one_f, one_f, one_i)
        has_ctx, vocab, nkeys = 0, 0, 0
        if ctx is not None:  # graphs without entries: every step goes to the root, -node_score
            has_ctx, tables = 1, (one_i, one_i, one_f, ctx.node_score, ctx.root)
    args: list[tuple[str, Any]] = [
        ("i32", bsz), ("i32", t_max), ("i32", k), ("i32", w), ("i32", c.blank), ("i64", vocab),
        ("ptr", tv), ("ptr", ti), ("ptr", lens_t.to(torch.int64).contiguous()),
        ("ptr", c.wb.to(torch.int64).contiguous()), ("ptr", frame0.to(torch.int64).contiguous()),
        ("ptr", f), ("ptr", i), ("ptr", v), ("ptr", tok_par), ("ptr", node_lp),
        *[("ptr", x) for x in scratch],
        ("i32", has_ctx), ("ptr", tables[0]), ("ptr", tables[1]), ("ptr", tables[2]),
        ("i64", nkeys), ("ptr", tables[3]), ("ptr", tables[4]),
    ]
    return args, (f, i, v)


def ctc_prefix_beam_frames_cuda(c: Any, tv: torch.Tensor, ti: torch.Tensor, kmask: torch.Tensor,
                                f: torch.Tensor, i: torch.Tensor, valid: torch.Tensor,
                                frame0: torch.Tensor, lens_t: torch.Tensor, ctx: Any,
                                tok_par: torch.Tensor, node_lp: torch.Tensor) -> Any:
    """The override: the new (F, I, valid), the chunk's nodes written into ``tok_par`` /
    ``node_lp``; ``NotImplemented`` where the kernel does not run."""
    if not enabled() or not tv.is_cuda or c.w > MAX_BEAM:
        return NotImplemented
    if not (tok_par.is_contiguous() and node_lp.is_contiguous()):
        return NotImplemented
    args, (f_new, i_new, v_new) = kernel_arguments(c, tv, ti, f, i, valid, frame0, lens_t, ctx,
                                                   tok_par, node_lp)
    packed = tuple(np.int32(x) if kind == "i32" else np.int64(x) if kind == "i64"
                   else np.uint64(x.data_ptr()) for kind, x in args)
    # the argument tensors stay referenced (args) until the launch is queued on the stream;
    # torch's caching allocator keeps their memory for the stream's pending work
    if not MODULE.launch(KERNEL, (tv.shape[0],), (LANES,), packed, tv.device):
        return NotImplemented
    del args
    return f_new, i_new, v_new.view(torch.bool)

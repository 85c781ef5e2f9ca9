"""The search as one CUDA kernel (numba.cuda): one thread block per utterance runs the whole
frame loop, with no kernel launch or host synchronisation per frame.

Same steps as :class:`~oasr_decoders_wfst.decoder.WfstDecoder` (Kaldi's FasterDecoder), done by
the block's threads with atomics (``_fused_kernel.search``; docs/wfst_decoder_gpu.md): a thread
per emitting arc, numbered by a block prefix sum over the tokens under the cutoff; the cutoff's
k-th best cost by ranking (tokens that fit the block) or quickselect; emitting arcs in two passes
(every candidate lowers its state's cost key in a dense per-state table; the candidate at the
minimum under the next cutoff claims the state and becomes a token); the epsilon closure in
rounds over a frontier (candidates that beat a state's cost lower it by atomic min, the one at
the minimum claims the state, updating its token in place or appending one). Word records as in
the tensor search. Ties between equal costs go to whichever thread claims first (the tensor
search takes the first candidate). Buffers have fixed capacities; an utterance that overflows
one is reported and decoded again by the tensor search.

On a GPU, with whole warps, the block prefix sum is done by warp shuffles; numba's simulator has
none, so there (and for a block size that is not a multiple of 32) the same kernel is compiled
with the shared-memory prefix sum (``_fused_kernel.build_kernel``).

Offline only (one call decodes whole utterances). Runs on CUDA, or on numba's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``, for tests on a machine without a GPU).
"""

from __future__ import annotations

import math
import os

import numpy as np

INT32_MAX = 2**31 - 1
#: threads per block (one block per utterance). Each thread walks a share of the frame's work, so
#: more threads per block pay where 64 utterances leave half the SMs idle. H200 (5000-word graph,
#: 64 x 30 s, beam 12, every setting 64/64 words equal to kaldi-decoder's): 0.0272-0.0286 s at
#: 1024 threads (10.1-10.7x kaldi-decoder on 16 processes with both sides timed repeatedly,
#: 8.8x in a call where it ran 20 % faster); the barrier-scan build
#: 0.0296 s at 1024, 0.0299 s at 768. Above 512 threads the kernel is built with at most
#: 65536 / threads registers a thread (64 at 1024, 80 at 768) so that the block launches.
#: ``OASR_WFST_FUSED_THREADS`` (<= 1024) and ``wfstbench --fused-threads`` to measure another GPU
THREADS = 1024
#: kernel variants (``OASR_WFST_FUSED_VARIANT``, ``variant=``, ``wfstbench --fused-variants``):
#: "arc", the one kernel (``_fused_kernel.search``), the default
VARIANTS = ("arc",)
DEFAULT_VARIANT = "arc"
_kernels: dict[tuple[str, bool, int | None], object] = {}


def _threads(threads: int | None) -> int:
    if threads is None:
        threads = int(os.environ.get("OASR_WFST_FUSED_THREADS", "") or THREADS)
    if not 1 <= threads <= 1024:
        raise ValueError(f"threads per block must be in 1..1024, not {threads}")
    return threads


def _variant(variant: str | None) -> str:
    if variant is None:
        variant = os.environ.get("OASR_WFST_FUSED_VARIANT", "") or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"fused kernel variant must be one of {VARIANTS}, not {variant!r}")
    return variant


def decode_fused(dec, log_probs, lengths=None, threads: int | None = None,
                 variant: str | None = None):  # fmt: skip
    """:meth:`WfstDecoder.decode` by the fused kernel; utterances that overflow a buffer are
    decoded again by the tensor search. Returns ``WfstHypothesis`` per row."""
    import torch

    from oasr_decoders_wfst.decoder import WfstHypothesis

    B, T = log_probs.shape[:2]
    lens = [T] * B if lengths is None else [int(n) for n in lengths]
    (rp, rw, rf), best, cost, fin, ovf = fused_decode(dec, log_probs, lens, threads=threads,
                                                       variant=variant)  # fmt: skip
    out = []
    for b in range(B):
        words, frames = [], []
        r = int(best[b])
        while r >= 0:
            words.append(int(rw[b, r]))
            frames.append(int(rf[b, r]))
            r = int(rp[b, r])
        words.reverse()
        frames.reverse()
        out.append(WfstHypothesis([dec.graph.words[i] for i in words], words, frames,
                                  float(cost[b]), bool(fin[b]), lens[b]))  # fmt: skip
    redo = [b for b in range(B) if ovf[b]]
    if redo:
        idx = torch.tensor(redo, device=log_probs.device)
        again = dec.decode(log_probs.index_select(0, idx), [lens[b] for b in redo], fused=False)
        for b, h in zip(redo, again, strict=True):
            out[b] = h
    return out


def simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM") == "1"


def fused_decode(dec, log_probs, lengths, threads: int | None = None, token_capacity: int | None = None,
                 record_capacity: int = 1 << 18, variant: str | None = None,
                 candidate_capacity: int | None = None):  # fmt: skip
    """Decode with the fused kernel: ``dec`` is a :class:`WfstDecoder` (its graph, options and
    device). Returns (records per utterance, best record, cost, reached final, overflowed).
    ``candidate_capacity`` (default 4 x tokens) per utterance: epsilon candidates of a round
    beyond it overflow; emitting candidates beyond it are recomputed."""
    import torch

    threads = _threads(threads)
    variant = _variant(variant)
    if not hasattr(np, "row_stack"):
        # numpy 2.5 dropped the alias; the numba on the H200 image still calls it while compiling
        # the kernel (AttributeError there otherwise)
        np.row_stack = np.vstack
    from numba import cuda

    sim = simulated()
    warp_scan = not sim and threads % 32 == 0
    # a block's registers must fit an SM's 65536: above 512 threads 65536 / threads (64 at 1024,
    # 80 at 768); at 512 the kernel's ~121 are capped at 128 so another compiler's few more
    # cannot stop the launch
    regs = None if sim else (65536 // threads) // 8 * 8 if threads > 512 else 128
    if (variant, warp_scan, regs) not in _kernels:
        from oasr_decoders_wfst import _fused_kernel

        _kernels[variant, warp_scan, regs] = _fused_kernel.build_kernel(warp_scan, regs)
    kernel = _kernels[variant, warp_scan, regs]
    g = dec.graph
    o = dec.options
    B, T, V = log_probs.shape
    dev = torch.device("cpu") if sim else log_probs.device
    S = g.num_states
    cap = token_capacity or min(max(4 * min(o.max_active, S), 4096), 1 << 17)
    if S < cap:
        cap = max(S, 16)

    def t_(x, dtype):
        return torch.as_tensor(x).to(dev, dtype).contiguous()

    emitting = g.ilabels != 0

    def csr(mask):
        counts = np.bincount(np.repeat(np.arange(S), np.diff(g.state_offsets))[mask], minlength=S)
        off = np.zeros(S + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        return off

    key = ("fused", str(dev))
    cache = dec.__dict__.setdefault("_fused_cache", {})
    if key not in cache:
        cache[key] = (
            t_(csr(emitting), torch.int64), t_(g.next_states[emitting], torch.int32),
            t_(g.ilabels[emitting] - 1, torch.int32), t_(g.olabels[emitting], torch.int32),
            t_(g.weights[emitting].astype(np.float64), torch.float64),
            t_(csr(~emitting), torch.int64), t_(g.next_states[~emitting], torch.int32),
            t_(g.olabels[~emitting], torch.int32),
            t_(g.weights[~emitting].astype(np.float64), torch.float64),
            t_(g.final_weights.astype(np.float64), torch.float64),
        )  # fmt: skip
    graph_arrays = cache[key]
    lp = log_probs.to(dev, torch.float32)
    if o.acoustic_scale != 1.0:
        lp = lp * o.acoustic_scale
    lp = lp.contiguous()
    lens = t_(np.asarray(lengths, dtype=np.int32), torch.int32)
    z = dict(device=dev)
    tok_state = torch.empty(B, 2, cap, dtype=torch.int32, **z)
    tok_cost = torch.empty(B, 2, cap, dtype=torch.float64, **z)
    tok_rec = torch.empty(B, 2, cap, dtype=torch.int32, **z)
    # per state: its cost key (inf's), then its token slot and epsilon claim (-1, -1: an int64 -1)
    table = torch.full((B * S, 2), -1, dtype=torch.int64, **z)
    table[:, 0] = torch.tensor(math.inf, dtype=torch.float64).view(torch.int64).item()
    table = table.view(-1)
    frontier = torch.empty(B, 2, cap, dtype=torch.int32, **z)
    ccap = candidate_capacity or 4 * cap
    cand_dest = torch.empty(B, ccap, dtype=torch.int32, **z)
    cand_word = torch.empty(B, ccap, dtype=torch.int32, **z)
    cand_cost = torch.empty(B, ccap, dtype=torch.float64, **z)
    cand_rec = torch.empty(B, ccap, dtype=torch.int32, **z)
    rec_prev = torch.empty(B, record_capacity, dtype=torch.int32, **z)
    rec_word = torch.empty(B, record_capacity, dtype=torch.int32, **z)
    rec_frame = torch.empty(B, record_capacity, dtype=torch.int32, **z)
    out_rec = torch.empty(B, dtype=torch.int32, **z)
    out_cost = torch.empty(B, dtype=torch.float64, **z)
    out_final = torch.empty(B, dtype=torch.int32, **z)
    status = torch.empty(B, dtype=torch.int32, **z)
    out_nrec = torch.empty(B, dtype=torch.int32, **z)
    # each token's first arc number and first emitting arc where they overflow shared memory
    tok_aoff = torch.empty(B, 2, cap, dtype=torch.int32, **z)
    args = [*graph_arrays, g.start, lp, lens, float(o.beam), int(o.max_active), int(o.min_active),
            float(o.beam_delta), tok_state, tok_cost, tok_rec, table, table.view(torch.int32),
            frontier, cand_dest, cand_word, cand_cost, cand_rec, rec_prev, rec_word, rec_frame,
            out_rec, out_cost, out_final, status, out_nrec, tok_aoff]  # fmt: skip
    if sim:
        first_rec = next(i for i, a in enumerate(args) if a is rec_prev)
        first_out = next(i for i, a in enumerate(args) if a is out_rec)
        args = [a.numpy() if isinstance(a, torch.Tensor) else a for a in args]
        kernel[B, threads](*args)
        outs = args[first_out : first_out + 5]  # out_rec, out_cost, out_final, status, out_nrec
        out = [torch.from_numpy(a) for a in outs[:4]]
        nrec = int(outs[4].max()) if B else 0
        recs = tuple(torch.from_numpy(a)[:, :nrec].numpy() for a in args[first_rec : first_rec + 3])
    else:
        stream = cuda.external_stream(torch.cuda.current_stream(dev).cuda_stream)
        kernel[B, threads, stream](*args)
        out = [x.cpu() for x in (out_rec, out_cost, out_final, status)]
        nrec = int(out_nrec.max()) if B else 0
        # only the records written: the chains are followed on the host
        recs = tuple(x[:, :nrec].cpu().numpy() for x in (rec_prev, rec_word, rec_frame))
    out = [x.numpy() for x in out]
    return recs, out[0], out[1], out[2].astype(bool), out[3].astype(bool)

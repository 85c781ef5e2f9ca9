"""CTC prefix beam search as batched tensor operations: the GPU path of the CTC families.

The same search as :class:`oasr.decoders.ctc.CTCPrefixBeamSearch` (WeNet's algorithm: per frame
the ``beam`` most likely tokens extend every prefix of the beam, equal prefixes merge by log-add,
the ``beam`` best prefixes survive; Viterbi peak frames as token times), written over a whole
batch of streams at once so that a frame is a fixed sequence of tensor operations with no host
synchronisation: it runs on any device, and on CUDA it is the fast path.

Per frame and batch row (``W`` = widest beam, ``K`` = ``min(W, vocab)`` candidate tokens, read
for the whole chunk by one top-k before the frame loop):

1. *prune*: the frame's top-``K`` tokens (ranks past a row's own beam are masked);
2. *extend*: each prefix ``j`` of the beam and candidate ``r`` make the target ``prefix_j +
   token_r`` (``W * K`` extension entries); blank and a repeat of the last token keep the prefix
   (``W`` stay entries);
3. *merge*: prefixes are identified by a 64-bit rolling hash with their parent's hash, so an
   extension that re-creates a prefix already in the beam (its parent in the beam, its last
   token among the candidates) is found with two small equality tests and merged into that
   prefix's stay entry, by log-add, exactly as the host search merges dictionary entries;
4. *keep*: the ``W`` best entries by total score (ties in the host search's insertion order: a
   stable sort by first-touch order, then a stable sort by score), gathered into the new beam.

Token times use the host search's Viterbi rules (including which of two equal-token sources
sets the time); they are kept as linked nodes (``token``, parent node; the node's frame is its
id divided by the beam width) written once per frame and read back only by :meth:`nbest`.

The frame loop of a chunk runs as one captured CUDA graph on CUDA (eagerly elsewhere), or as a
kernel provider's fused loop where one is registered for the op ``ctc_prefix_beam_frames``
(oasr-kernels: one launch per chunk); see docs/ctc_decoder_gpu.md.

Streams: :class:`GPUCTCPrefixBeamSearch` is one stream's beam (the host search's interface:
``step`` / ``nbest`` / ``best``); :func:`step_streams` advances several streams' chunks in one
batch (their state tensors stacked, the result split back); :func:`ctc_prefix_beam_search_gpu`
is the offline batched call. Chunked equals offline.

Hotwords: a stream may carry a :class:`~oasr.decoders.context_graph.ContextGraph`; an extension
adds the graph's step bonus to the prefix's context score, ranking uses acoustic + context
score (WeNet's ``total_score``), and :meth:`nbest` takes back unfinished matches
(``ContextGraph.finalize``) before ranking the result.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from oasr.decoders.context_graph import ContextGraph
from oasr.decoders.hypothesis import Hypothesis
from oasr.stream_cache import CAPTURE_LOCK

__all__ = ["GPUCTCPrefixBeamSearch", "ctc_prefix_beam_search_gpu", "nbest_streams", "step_streams"]

NEG_INF = float("-inf")
_HASH_MUL = 1099511628211  # FNV-1a 64-bit prime; int64 products wrap, which is what we want
_BIG = 1 << 40
# state columns
_S, _NS, _VS, _VNS, _CTX = range(5)
_H, _PH, _LAST, _PTR_S, _PTR_NS, _UP_NS, _CST = range(7)


def _logadd(a: Any, b: Any) -> Any:
    """log(exp(a) + exp(b)) elementwise, -inf for two -inf (one kernel; equals the host's
    ``log_add`` to the last bits of float64)."""
    import torch

    return torch.logaddexp(a, b)


class _Context:
    """The context graphs of a batch as device tables (global state ids; 0 is a state with no
    transitions, the root of rows without hotwords)."""

    def __init__(self, graphs: Sequence[ContextGraph | None], vocab: int, device: Any) -> None:
        import torch

        keys: list[int] = []
        nxt: list[int] = []
        bonus: list[float] = []
        node_score = [0.0]
        self.offsets: list[int] = []
        placed: dict[int, int] = {}  # one copy of a graph that several rows share
        for g in graphs:
            if g is None:
                self.offsets.append(0)
                continue
            if id(g) in placed:
                self.offsets.append(placed[id(g)])
                continue
            off = placed[id(g)] = len(node_score)
            self.offsets.append(off)
            t = g.tables(vocab)
            keys += [off * vocab + k for k in t.keys]
            nxt += [off + n for n in t.next]
            bonus += t.bonus
            node_score += t.node_score
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.vocab = vocab
        self.keys = torch.tensor([keys[i] for i in order], dtype=torch.int64, device=device)
        self.next = torch.tensor([nxt[i] for i in order], dtype=torch.int64, device=device)
        self.bonus = torch.tensor([bonus[i] for i in order], dtype=torch.float64, device=device)
        self.node_score = torch.tensor(node_score, dtype=torch.float64, device=device)
        self.root = torch.tensor(self.offsets, dtype=torch.int64, device=device)

    def step(self, state: Any, token: Any) -> tuple[Any, Any]:
        """(bonus, next state) of ``ContextGraph.step`` for (B, W, K) global states and tokens."""
        import torch

        n = self.keys.numel()
        base = self.node_score[state]
        if n == 0:
            return -base, self.root[:, None, None].expand_as(token)
        k1 = state * self.vocab + token
        i1 = torch.searchsorted(self.keys, k1).clamp_(max=n - 1)
        hit1 = self.keys[i1] == k1
        root = self.root[:, None, None]
        k2 = root * self.vocab + token
        i2 = torch.searchsorted(self.keys, k2).clamp_(max=n - 1)
        hit2 = self.keys[i2] == k2
        bonus = torch.where(hit1, self.bonus[i1], torch.where(hit2, self.bonus[i2] - base, -base))
        nxt = torch.where(hit1, self.next[i1], torch.where(hit2, self.next[i2], root.expand_as(token)))
        return bonus, nxt


class GPUCTCPrefixBeamSearch:
    """One stream's CTC prefix beam on a device; the interface of the host search
    (:class:`oasr.decoders.ctc.CTCPrefixBeamSearch`): ``step(log_probs (T, V))`` any number of
    frames at a time, ``nbest()`` / ``best()`` with ``times`` = absolute peak frames. Several
    streams advance together with :func:`step_streams`."""

    def __init__(self, beam_size: int, blank: int = 0, device: Any = None,
                 context_graph: ContextGraph | None = None) -> None:
        import torch

        if beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        self.beam_size = int(beam_size)
        self.blank = int(blank)
        self.device = torch.device(device) if device is not None else None
        self.context_graph = context_graph
        self.frame = 0
        self._chunks: list[tuple[Any, Any]] = []  # (tok_par (T, W, 2) int64, lp (T, W) f64)
        self._state: tuple[Any, Any, Any] | None = None  # F (W, 5), I (W, 7), valid (W,)

    def _initial(self, device: Any) -> tuple[Any, Any, Any]:
        import torch

        w = self.beam_size
        f = torch.full((w, 5), NEG_INF, dtype=torch.float64, device=device)
        f[0] = torch.tensor([0.0, NEG_INF, 0.0, 0.0, 0.0], dtype=torch.float64)
        f[:, _CTX] = 0.0
        i = torch.full((w, 7), -1, dtype=torch.int64, device=device)
        i[:, _H] = 0
        i[:, _CST] = 0
        valid = torch.zeros(w, dtype=torch.bool, device=device)
        valid[0] = True
        return f, i, valid

    def step(self, log_probs: Any) -> None:
        step_streams([self], [log_probs])

    def nbest(self) -> list[Hypothesis]:
        return _nbest([self])[0]

    def best(self) -> Hypothesis:
        return self.nbest()[0]


def step_streams(streams: Sequence[GPUCTCPrefixBeamSearch], log_probs: Sequence[Any]) -> None:
    """Advance each stream by its chunk of log-posteriors ((T_i, V), any T_i) in one batch."""
    import torch

    if len(streams) != len(log_probs):
        raise ValueError("one chunk per stream")
    lps = [torch.as_tensor(x) for x in log_probs]
    live = [i for i, x in enumerate(lps) if x.shape[0] > 0]
    if not live:
        return
    streams = [streams[i] for i in live]
    lps = [lps[i] for i in live]
    device = streams[0].device or lps[0].device
    if len(lps) == 1:
        lp = lps[0].to(device).unsqueeze(0)
    else:
        lp = torch.nn.utils.rnn.pad_sequence([x.to(device) for x in lps], batch_first=True)
    _step_batch(streams, lp, [x.shape[0] for x in lps])


def _step_batch(streams: Sequence[GPUCTCPrefixBeamSearch], lp: Any, lens: list[int]) -> None:
    """Advance ``streams`` by the rows of a padded (B, T, V) chunk (``lens`` frames each)."""
    import torch

    device = lp.device
    blanks = {s.blank for s in streams}
    if len(blanks) != 1:
        raise ValueError("streams batched together must share the blank id")
    vocab = lp.shape[-1]
    for s in streams:
        if s._state is None:
            s._state = s._initial(device)
    w = max(s.beam_size for s in streams)
    f = torch.stack([_pad_rows(s._state[0], w, NEG_INF) for s in streams])
    i = torch.stack([_pad_rows(s._state[1], w, -1) for s in streams])
    valid = torch.stack([_pad_rows(s._state[2], w, False) for s in streams])
    beams = [s.beam_size for s in streams]
    frames = [s.frame for s in streams]
    graphs = [s.context_graph for s in streams]
    ctx = _Context(graphs, vocab, device) if any(g is not None for g in graphs) else None
    if ctx is not None:  # local state ids -> the batch's global ids
        i[:, :, _CST] += ctx.root[:, None]
    f, i, valid, tok_par, node_lp = _advance(lp, lens, f, i, valid, beams, frames,
                                             blanks.pop(), ctx)
    if ctx is not None:
        i[:, :, _CST] -= ctx.root[:, None]
    for b, s in enumerate(streams):
        wb = s.beam_size
        s._state = (f[b, :wb], i[b, :wb], valid[b, :wb])
        if lens[b]:
            s._chunks.append((tok_par[b, : lens[b], :wb], node_lp[b, : lens[b], :wb]))
        s.frame += lens[b]


def _pad_rows(x: Any, w: int, value: Any) -> Any:
    import torch

    if x.shape[0] == w:
        return x
    pad = torch.full((w - x.shape[0], *x.shape[1:]), value, dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])


def _advance(lp: Any, lens: list[int], f: Any, i: Any, valid: Any, beams: list[int],
             frames: list[int], blank: int, ctx: _Context | None
             ) -> tuple[Any, Any, Any, Any, Any]:  # fmt: skip
    """Run every frame of a (B, T, V) chunk over the stacked beams; returns the new state and
    the chunk's nodes ((B, T, W, 2) token / parent, (B, T, W) log-prob)."""
    import torch

    dev = lp.device
    bsz, t_max, vocab = lp.shape
    w = f.shape[1]
    k = min(w, vocab)
    with torch.no_grad():
        tv, ti = lp.topk(k, dim=-1)  # one pass for the whole chunk: the only vocab-wide work
    tv = tv.to(torch.float64)
    wb = torch.tensor(beams, dtype=torch.int64, device=dev)
    kmask = torch.arange(k, device=dev)[None, :] < wb[:, None]  # a row's own beam of tokens
    lens_t = torch.tensor(lens, dtype=torch.int64, device=dev)
    frame0 = torch.tensor(frames, dtype=torch.int64, device=dev)
    tok_par = torch.empty((bsz, t_max, w, 2), dtype=torch.int64, device=dev)
    node_lp = torch.empty((bsz, t_max, w), dtype=torch.float64, device=dev)
    c = _Consts(bsz, w, k, wb, blank, dev)
    fused = _frames_override(dev)
    if fused is not None:  # a kernel provider's fused frame loop (oasr-kernels on CUDA)
        state = fused(c, tv, ti, kmask, f, i, valid, frame0, lens_t, ctx, tok_par, node_lp)
        if state is not NotImplemented:
            return (*state, tok_par, node_lp)
    if _use_graph(dev, t_max):
        state = _advance_graphed(c, tv, ti, kmask, f, i, valid, frame0, lens_t, ctx, tok_par,
                                 node_lp)
        if state is not None:
            return (*state, tok_par, node_lp)
    ragged = min(lens) != t_max
    for t in range(t_max):
        nf, ni, nvalid, nodes, nlp = _frame(c, tv[:, t], ti[:, t], kmask, f, i, valid,
                                            frame0 + t, ctx)
        tok_par[:, t] = nodes
        node_lp[:, t] = nlp
        if ragged:  # rows whose chunk has ended keep their beam
            act = (lens_t > t)[:, None]
            nf = torch.where(act[..., None], nf, f)
            ni = torch.where(act[..., None], ni, i)
            nvalid = torch.where(act, nvalid, valid)
        f, i, valid = nf, ni, nvalid
    return f, i, valid, tok_par, node_lp


#: the op a kernel provider may override with a fused frame loop:
#: ``fn(consts, tv, ti, kmask, F, I, valid, frame0, lens, context, tok_par, node_lp)`` returns
#: the new (F, I, valid) and writes the chunk's nodes, or ``NotImplemented``
FRAMES_OP = "ctc_prefix_beam_frames"


def _frames_override(device: Any) -> Any:
    from oasr.layers._dispatch import declare_op, get_override

    declare_op(FRAMES_OP)
    return get_override(FRAMES_OP, device.type)


#: chunks at least this long run as one captured CUDA graph replayed per frame (a frame is
#: ~100 small kernels: launched from a graph they cost a fraction of eager launches)
GRAPH_MIN_FRAMES = 32
_GRAPH_FAILED: list[str] = []


def _use_graph(device: Any, frames: int) -> bool:
    """CUDA, a long enough chunk, capture not failed before, ``OASR_CTC_CUDA_GRAPHS`` not 0."""
    import os

    return (device.type == "cuda" and frames >= GRAPH_MIN_FRAMES and not _GRAPH_FAILED
            and os.environ.get("OASR_CTC_CUDA_GRAPHS", "1") != "0")


def _device_loop(c: _Consts, tv: Any, ti: Any, kmask: Any, f: Any, i: Any, valid: Any,
                 frame0: Any, lens_t: Any, ctx: _Context | None, tok_par: Any, node_lp: Any
                 ) -> tuple[Any, tuple[Any, Any, Any]]:  # fmt: skip
    """One frame as a function with no host values: the frame index lives on the device and
    each call advances it, the state lives in fixed buffers (what a CUDA graph can replay).
    Returns (the frame function, the state buffers)."""
    import torch

    f, i, valid = f.clone(), i.clone(), valid.clone()
    t_idx = torch.zeros(1, dtype=torch.int64, device=f.device)

    def body() -> None:
        nf, ni, nvalid, nodes, nlp = _frame(c, tv.index_select(1, t_idx).squeeze(1),
                                            ti.index_select(1, t_idx).squeeze(1), kmask, f, i,
                                            valid, frame0 + t_idx, ctx)
        act = (lens_t > t_idx)[:, None]
        f.copy_(torch.where(act[..., None], nf, f))
        i.copy_(torch.where(act[..., None], ni, i))
        valid.copy_(torch.where(act, nvalid, valid))
        tok_par.index_copy_(1, t_idx, nodes.unsqueeze(1))
        node_lp.index_copy_(1, t_idx, nlp.unsqueeze(1))
        t_idx.add_(1)

    return body, (f, i, valid)


def _advance_graphed(c: _Consts, tv: Any, ti: Any, kmask: Any, f: Any, i: Any, valid: Any,
                     frame0: Any, lens_t: Any, ctx: _Context | None, tok_par: Any, node_lp: Any
                     ) -> tuple[Any, Any, Any] | None:  # fmt: skip
    """The frame loop as one captured CUDA graph of :func:`_device_loop`'s frame, replayed
    ``T - 1`` times after an eager first frame. ``None`` if capture failed (the caller then
    runs the chunk eagerly from its unchanged state)."""
    import logging

    import torch

    body, state = _device_loop(c, tv, ti, kmask, f, i, valid, frame0, lens_t, ctx, tok_par,
                               node_lp)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # frame 0, for real (also warms up the kernels, as capture requires)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        # one capture at a time, not invalidated by other threads (oasr.stream_cache.GraphSteps)
        with CAPTURE_LOCK, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            body()
    except Exception as e:  # pragma: no cover - depends on the device and torch build
        _GRAPH_FAILED.append(repr(e))
        logging.getLogger(__name__).warning("CTC beam search: CUDA graph capture failed (%s); "
                                            "running eagerly", e)
        return None
    for _ in range(1, tv.shape[1]):
        graph.replay()
    return state


class _Consts:
    """Index tensors every frame uses (made once per chunk)."""

    def __init__(self, bsz: int, w: int, k: int, wb: Any, blank: int, dev: Any) -> None:
        import torch

        self.w, self.k, self.blank, self.wb = w, k, blank, wb
        self.widx = torch.arange(w, device=dev)[None, :]  # (1, W)
        ridx = torch.arange(k, device=dev)
        # first-touch order of an extension entry (rank r, prefix j, 0/1 for *u-u -> *uu)
        self.ext_key = ((ridx[None, None, :] * w + self.widx[:, :, None]) * 2).expand(bsz, w, k)
        self.neg = torch.tensor(NEG_INF, dtype=torch.float64, device=dev)
        self.big = torch.tensor(_BIG, dtype=torch.int64, device=dev)
        self.minus1 = torch.tensor(-1, dtype=torch.int64, device=dev)


def _frame(c: _Consts, tv: Any, ti: Any, kmask: Any, f: Any, i: Any, valid: Any, frame: Any,
           ctx: _Context | None) -> tuple[Any, Any, Any, Any, Any]:
    """One frame for every row: (B, K) candidates ``tv`` (log-probs) / ``ti`` (tokens)."""
    import torch

    w, k, neg, big = c.w, c.k, c.neg, c.big
    bsz = f.shape[0]
    s, ns, vs, vns, cscore = f.unbind(-1)
    h, ph, last, ptr_s, ptr_ns, up_ns, cst = i.unbind(-1)
    sc = _logadd(s, ns)
    pick_s = vs > vns  # the host's viterbi_score() / times() choice
    vit = torch.where(pick_s, vs, vns)
    ptr_t = torch.where(pick_s, ptr_s, ptr_ns)

    # blank among the candidates (once per row)
    isb = (ti == c.blank) & kmask
    has_b = isb.any(-1, keepdim=True) & valid
    pb = torch.where(isb, tv, neg).amax(-1, keepdim=True)
    rb = isb.long().argmax(-1, keepdim=True)
    # each prefix's last token among the candidates (an empty prefix has last -1)
    m = (ti[:, None, :] == last[:, :, None]) & kmask[:, None, :]
    has_l = m.any(-1) & valid
    r_l = m.long().argmax(-1)
    p_l = torch.where(m, tv[:, None, :], neg).amax(-1)
    # each prefix's parent (the prefix minus its last token) in the beam
    par = (ph[:, :, None] == h[:, None, :]) & valid[:, None, :] & (last >= 0)[:, :, None]
    has_p = par.any(-1) & valid
    p = par.long().argmax(-1)
    src_b = has_p & has_l  # the parent extended by this prefix's last token: merges here
    pf = torch.stack([s, sc, vs, vit], -1).gather(1, p[..., None].expand(bsz, w, 4))
    pi = torch.stack([ptr_s, ptr_t, last], -1).gather(1, p[..., None].expand(bsz, w, 3))
    ext2p = pi[..., 2] == last  # the parent ends in the same token: *u-u -> *uu (blank paths)
    b_ns = torch.where(src_b, torch.where(ext2p, pf[..., 0], pf[..., 1]) + p_l, neg)
    vb = torch.where(src_b, torch.where(ext2p, pf[..., 2], pf[..., 3]) + p_l, neg)
    tb = torch.where(ext2p, pi[..., 0], pi[..., 1])

    # stay entries: the prefix itself (blank, or its last token repeated)
    st_s = torch.where(has_b, sc + pb, neg)
    st_vs = torch.where(has_b, vit + pb, neg)
    va = torch.where(has_l, vns + p_l, neg)
    st_ns = _logadd(torch.where(has_l, ns + p_l, neg), b_ns)
    st_vns = torch.maximum(va, vb)
    # which source sets the time (the host's strict '<' and its cur_token_prob rule): the
    # repeat goes first when this prefix precedes its parent in the beam
    a_first = ~src_b | (c.widx < p)
    choose_b = torch.where(a_first, vb > va, vb > neg)
    st_made = choose_b | (va > neg)
    st_par = torch.where(choose_b, tb, up_ns)
    kb = (rb * w + c.widx) * 2
    ka = (r_l * w + c.widx) * 2
    kx = (r_l * w + p) * 2 + ext2p.long()
    st_key = torch.minimum(torch.minimum(torch.where(has_b, kb, big), torch.where(has_l, ka, big)),
                           torch.where(src_b, kx, big))
    st_exists = has_b | has_l

    # extension entries: prefix j + candidate r
    u = ti[:, None, :].expand(bsz, w, k)
    prob = tv[:, None, :].expand(bsz, w, k)
    ext2 = u == last[:, :, None]
    merged = torch.zeros((bsz, w * k + 1), dtype=torch.bool, device=f.device)
    merged.scatter_(1, torch.where(src_b, p * k + r_l, w * k), True)
    e_exists = (valid[:, :, None] & kmask[:, None, :] & (u != c.blank)
                & ~merged[:, : w * k].view(bsz, w, k))
    e_ns = torch.where(ext2, s[..., None], sc[..., None]) + prob
    e_vns = torch.where(ext2, vs[..., None], vit[..., None]) + prob
    e_par = torch.where(ext2, ptr_s[..., None], ptr_t[..., None])
    e_key = c.ext_key + ext2.long()
    e_h = h[..., None] * _HASH_MUL + u + 1
    if ctx is not None:
        bonus, e_cst = ctx.step(cst[..., None].expand(bsz, w, k), u)
        e_ctx = cscore[..., None] + bonus
    else:
        e_ctx = cscore[..., None].expand(bsz, w, k)
        e_cst = cst[..., None].expand(bsz, w, k)

    n_ext = w * k
    # candidate fields: floats [s, ns, vs, vns, ctx, node lp], ints [h, ph, last, ptr_s,
    # node parent, context state, node made]
    cf = torch.cat([
        torch.stack([st_s, st_ns, st_vs, st_vns, cscore, p_l], -1),
        torch.stack([neg.expand(bsz, w, k), e_ns, neg.expand(bsz, w, k), e_vns, e_ctx, prob],
                    -1).view(bsz, n_ext, 6),
    ], 1)
    ci = torch.cat([
        torch.stack([h, ph, last, ptr_t, st_par, cst, st_made.long()], -1),
        torch.stack([e_h, h[..., None].expand(bsz, w, k), u, c.minus1.expand(bsz, w, k), e_par,
                     e_cst, (e_vns > neg).long()], -1).view(bsz, n_ext, 7),
    ], 1)
    total = _logadd(cf[..., 0], cf[..., 1]) + cf[..., 4]
    exists = torch.cat([st_exists, e_exists.view(bsz, n_ext)], 1) & (total > neg)
    key = torch.cat([st_key, e_key.reshape(bsz, n_ext)], 1)
    # keep: the best W by total score, ties in first-touch order (two stable sorts)
    order = torch.where(exists, key, big).sort(dim=-1, stable=True).indices
    ranked = torch.where(exists, total, neg).gather(1, order)
    best = ranked.sort(dim=-1, descending=True, stable=True).indices[:, :w]
    pick = order.gather(1, best)
    nf = cf.gather(1, pick[..., None].expand(bsz, w, 6))
    ni = ci.gather(1, pick[..., None].expand(bsz, w, 7))
    nvalid = exists.gather(1, pick) & (c.widx < c.wb[:, None])
    made = (ni[..., 6] == 1) & nvalid
    node_id = frame[:, None] * c.wb[:, None] + c.widx
    ptr_new = torch.where(made, node_id, c.minus1)
    up_new = torch.where(made, ni[..., 4], c.minus1)
    new_i = torch.stack([ni[..., 0], ni[..., 1], ni[..., 2], ni[..., 3], ptr_new, up_new,
                         ni[..., 5]], -1)
    nodes = torch.stack([ni[..., 2], up_new], -1)
    return nf[..., :5], new_i, nvalid, nodes, nf[..., 5]


def nbest_streams(streams: Sequence[GPUCTCPrefixBeamSearch]) -> list[list[Hypothesis]]:
    """The n-best of several streams at once (one device-to-host copy per tensor kind for all
    of them, instead of one wait per stream): a streaming step's partial results."""
    return _nbest(streams)


def _nbest(streams: Sequence[GPUCTCPrefixBeamSearch]) -> list[list[Hypothesis]]:
    """Read the beams back (one copy per tensor kind for all streams) and follow the token
    nodes of every hypothesis at once."""
    import numpy as np
    import torch

    out: list[list[Hypothesis]] = [[] for _ in streams]
    todo = [b for b, s in enumerate(streams) if s._state is not None]
    for b, s in enumerate(streams):
        if s._state is None:
            out[b] = [Hypothesis([], 0.0, [], [])]
    if not todo:
        return out
    fs = torch.cat([streams[b]._state[0] for b in todo]).cpu().numpy()
    ints = torch.cat([streams[b]._state[1] for b in todo]).cpu().numpy()
    valid = torch.cat([streams[b]._state[2] for b in todo]).cpu().numpy()
    tok_par = [torch.cat([c[0] for c in streams[b]._chunks]).reshape(-1, 2) if streams[b]._chunks
               else torch.zeros((0, 2), dtype=torch.int64) for b in todo]
    lps = [torch.cat([c[1] for c in streams[b]._chunks]).reshape(-1) if streams[b]._chunks
           else torch.zeros(0, dtype=torch.float64) for b in todo]
    sizes = [x.shape[0] for x in tok_par]
    nodes = torch.cat([x.cpu() for x in tok_par]).numpy() if sum(sizes) else np.zeros((0, 2), np.int64)
    node_lp = torch.cat([x.cpu() for x in lps]).numpy() if sum(sizes) else np.zeros(0)
    base = np.cumsum([0, *sizes[:-1]]).astype(np.int64)
    rows = np.concatenate([np.full(streams[b].beam_size, base[n], np.int64) for n, b in enumerate(todo)])
    widths = np.concatenate([np.full(streams[b].beam_size, streams[b].beam_size, np.int64)
                             for b in todo])
    s_, ns_, vs_, vns_ = fs[:, _S], fs[:, _NS], fs[:, _VS], fs[:, _VNS]
    ptr = np.where(vs_ > vns_, ints[:, _PTR_S], ints[:, _PTR_NS])
    ptr = np.where(valid, ptr, -1)
    # follow every hypothesis' node chain at once: depth k of all live chains per iteration
    n_rows = len(ptr)
    depth = np.zeros(n_rows, np.int64)
    steps: list[tuple[Any, Any, Any, Any]] = []
    cur = ptr.copy()
    while True:
        live = np.nonzero(cur >= 0)[0]
        if live.size == 0:
            break
        g = rows[live] + cur[live]
        steps.append((live, nodes[g, 0], cur[live] // widths[live], node_lp[g]))
        depth[live] += 1
        cur[live] = nodes[g, 1]
    longest = len(steps)
    tok_m = np.zeros((n_rows, longest), np.int64)
    time_m = np.zeros((n_rows, longest), np.int64)
    lp_m = np.zeros((n_rows, longest), np.float64)
    for k, (live, tk, fr, lv) in enumerate(steps):
        tok_m[live, k], time_m[live, k], lp_m[live, k] = tk, fr, lv
    toks = [tok_m[r, : depth[r]][::-1].tolist() for r in range(n_rows)]
    times = [time_m[r, : depth[r]][::-1].tolist() for r in range(n_rows)]
    tlps = [lp_m[r, : depth[r]][::-1].tolist() for r in range(n_rows)]
    row = 0
    for b in todo:
        st = streams[b]
        g = st.context_graph
        hyps = []
        for j in range(st.beam_size):
            r = row + j
            if not valid[r]:
                continue
            score = _host_logadd(float(s_[r]), float(ns_[r]))
            if g is not None:
                score += float(fs[r, _CTX]) + g.finalize(int(ints[r, _CST]))
            hyps.append(Hypothesis(toks[r], score, times[r], tlps[r]))
        row += st.beam_size
        if g is not None:
            hyps.sort(key=lambda x: x.score, reverse=True)
        out[b] = hyps
    return out


def _host_logadd(a: float, b: float) -> float:
    if a == NEG_INF and b == NEG_INF:
        return NEG_INF
    m = max(a, b)
    return m + math.log(math.exp(a - m) + math.exp(b - m))


def ctc_prefix_beam_search_gpu(log_probs: Any, lengths: Sequence[int] | Any | None = None,
                               beam_size: int | Sequence[int] = 10, blank: int = 0,
                               context_graphs: Sequence[ContextGraph | None] | None = None
                               ) -> list[list[Hypothesis]]:  # fmt: skip
    """n-best lists (best first) for each item of a (B, T, V) batch (or one (T, V) input), on
    the batch's device; ``beam_size`` per item or one for all; ``context_graphs`` per item."""
    import torch

    lp = torch.as_tensor(log_probs)
    if lp.dim() == 2:
        lp = lp.unsqueeze(0)
    n = lp.shape[0]
    lens = [lp.shape[1]] * n if lengths is None else [int(x) for x in lengths]
    beams = [int(beam_size)] * n if isinstance(beam_size, int) else [int(x) for x in beam_size]
    graphs = list(context_graphs) if context_graphs is not None else [None] * n
    if not len(beams) == len(graphs) == len(lens) == n:
        raise ValueError("beam_size, context_graphs and lengths need one value per item")
    streams = [GPUCTCPrefixBeamSearch(beams[b], blank, lp.device, graphs[b]) for b in range(n)]
    if n and lp.shape[1]:
        _step_batch(streams, lp, lens)
    return _nbest(streams)

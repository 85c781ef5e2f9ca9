"""Generic CTC decoders: greedy, prefix beam search (offline or incremental), U2/U2++ attention
rescoring, and token / word timestamps with confidences from the CTC alignment.

Inputs are CTC log-posteriors, (T, V) for one utterance or (B, T, V) with lengths; anything with
``.tolist()`` or a numpy array works, torch tensors stay where they are until the per-frame top-k
is read. The prefix beam search follows WeNet's ``ctc_prefix_beam_search`` exactly (same first
pass top-k per frame, same log-add, same Viterbi peak times, same tie order), so given the same
log-posteriors it returns the same n-best, scores and times.

Times are *encoder frame indices*; :func:`token_timestamps` turns them into seconds with the
model's frame shift (``subsampling * hop / sample_rate``, 40 ms for a x4 model at 10 ms hop).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from oasr.decoders.hypothesis import Hypothesis

__all__ = [
    "CTCHypothesis",
    "CTCPrefixBeamSearch",
    "CTCGreedySearch",
    "RescoringResult",
    "TokenTiming",
    "attention_rescoring",
    "build_rescoring_inputs",
    "ctc_greedy_search",
    "ctc_prefix_beam_search",
    "group_words",
    "log_add",
    "token_timestamps",
]

NEG_INF = float("-inf")


def log_add(*args: float) -> float:
    """``log(sum(exp(a)))`` of the arguments, exact for all -inf."""
    if all(a == NEG_INF for a in args):
        return NEG_INF
    a_max = max(args)
    return a_max + math.log(sum(math.exp(a - a_max) for a in args))


# One CTC result: tokens (no blanks), their peak frames and per-token log-probabilities at those
# frames, the total score (prefix beam: log of the summed path probability; greedy: sum of the
# frame maxima). The type is shared with the transducer decoders (oasr.decoders.hypothesis).
CTCHypothesis = Hypothesis


def _rows(log_probs: Any) -> list[list[float]]:
    if hasattr(log_probs, "detach"):
        log_probs = log_probs.detach().float().cpu()
    return log_probs.tolist()


# -- greedy --------------------------------------------------------------------------------------


class CTCGreedySearch:
    """Incremental best-path decoding: ``step(log_probs (T, V))`` any number of frames at a time;
    ``result()`` is the hypothesis so far. Times are the first frame of each emitted token's run;
    a token's log-probability is the best frame of its run."""

    def __init__(self, blank: int = 0) -> None:
        self.blank = blank
        self.frame = 0
        self.prev = blank
        self.hyp = CTCHypothesis(tokens=[])

    def step(self, log_probs: Any) -> None:
        import torch

        lp = torch.as_tensor(log_probs)
        if lp.shape[0] == 0:
            return
        best, idx = lp.float().max(dim=-1)
        self._advance(best.tolist(), idx.tolist())

    def _advance(self, best_l: list[float], idx_l: list[int]) -> None:
        """Consume frames given as each frame's best log-probability and token."""
        h = self.hyp
        for t, (v, u) in enumerate(zip(best_l, idx_l, strict=True)):
            h.score += v
            if u != self.blank:
                if u != self.prev:
                    h.tokens.append(u)
                    h.times.append(self.frame + t)
                    h.token_logprobs.append(v)
                elif v > h.token_logprobs[-1]:
                    h.token_logprobs[-1] = v
            self.prev = u
        self.frame += len(best_l)

    def result(self) -> CTCHypothesis:
        h = self.hyp
        return CTCHypothesis(list(h.tokens), h.score, list(h.times), list(h.token_logprobs))


def ctc_greedy_search(log_probs: Any, lengths: Sequence[int] | Any | None = None,
                      blank: int = 0) -> list[CTCHypothesis]:
    """Best path of each item of a (B, T, V) batch (or one (T, V) input -> a list of one)."""
    import torch

    lp = torch.as_tensor(log_probs)
    if lp.dim() == 2:
        lp = lp.unsqueeze(0)
    lens = [lp.shape[1]] * lp.shape[0] if lengths is None else [int(n) for n in lengths]
    # one max over the whole batch and one device-to-host copy: a row at a time would wait on
    # the device once per row (128 waits for a batch of 128 on a GPU)
    best, idx = lp.float().max(dim=-1)
    best_np = best.cpu().numpy()
    idx_np = idx.to(torch.int32).cpu().numpy()
    return [_greedy_row(best_np[b, : lens[b]], idx_np[b, : lens[b]], blank)
            for b in range(lp.shape[0])]


def _greedy_row(best: Any, idx: Any, blank: int) -> CTCHypothesis:
    """:meth:`CTCGreedySearch.step` over one whole row of frame maxima, in numpy (no Python
    step per frame: 128 x 30 s is 48 000 frames). The same values: the score is summed in order
    in float64, as the step-wise search adds Python floats."""
    import numpy as np

    if not len(idx):
        return CTCHypothesis(tokens=[])
    prev = np.empty_like(idx)
    prev[0] = blank
    prev[1:] = idx[:-1]
    emitted = idx != blank
    starts = np.flatnonzero(emitted & (idx != prev))
    frames = np.flatnonzero(emitted)  # every frame of a token's run (runs only grow by repeats)
    logprobs = np.full(len(starts), -np.inf, dtype=np.float32)
    np.maximum.at(logprobs, np.searchsorted(starts, frames, side="right") - 1, best[frames])
    return CTCHypothesis(tokens=idx[starts].tolist(),
                         score=float(np.cumsum(best, dtype=np.float64)[-1]),
                         times=starts.tolist(), token_logprobs=logprobs.tolist())


# -- prefix beam search ----------------------------------------------------------------------------


class _Prefix:
    __slots__ = ("s", "ns", "v_s", "v_ns", "cur_token_prob", "times_s", "times_ns", "lp_s", "lp_ns",
                 "ctx", "cstate", "has_ctx")

    def __init__(self, s: float = NEG_INF, ns: float = NEG_INF, v_s: float = NEG_INF,
                 v_ns: float = NEG_INF) -> None:
        self.s = s  # log prob of paths ending in blank
        self.ns = ns  # ... ending in the last token
        self.v_s = v_s  # Viterbi (best single path) versions, for times
        self.v_ns = v_ns
        self.cur_token_prob = NEG_INF
        self.times_s: list[int] = []
        self.times_ns: list[int] = []
        self.lp_s: list[float] = []  # log-prob of each token at its peak frame (Viterbi path)
        self.lp_ns: list[float] = []
        self.ctx = 0.0  # hotword bonus of this prefix (context graph), and the graph state
        self.cstate = 0
        self.has_ctx = False

    def score(self) -> float:
        return log_add(self.s, self.ns)

    def viterbi_score(self) -> float:
        return self.v_s if self.v_s > self.v_ns else self.v_ns

    def times(self) -> list[int]:
        return self.times_s if self.v_s > self.v_ns else self.times_ns

    def lps(self) -> list[float]:
        return self.lp_s if self.v_s > self.v_ns else self.lp_ns


class CTCPrefixBeamSearch:
    """Incremental CTC prefix beam search (WeNet's algorithm, with WeNet's context biasing).

    ``step(log_probs (T, V))`` consumes frames (any number per call: streaming chunks);
    ``nbest()`` returns the current beam, best first, as :class:`CTCHypothesis` with
    ``times`` = Viterbi peak frames (absolute, counted from the first frame ever fed).

    With a ``context_graph`` (:class:`oasr.decoders.context_graph.ContextGraph`, hotwords) a
    prefix carries the graph's bonus for its tokens (``ContextGraph.step`` per appended token);
    the beam is ranked by acoustic score + bonus, and ``nbest()`` takes back the bonus of an
    unfinished match (``finalize``): its ``score`` is acoustic + final bonus."""

    def __init__(self, beam_size: int, blank: int = 0, context_graph: Any = None) -> None:
        if beam_size < 1:
            raise ValueError("beam_size must be >= 1")
        self.beam_size = beam_size
        self.blank = blank
        self.frame = 0
        self.context_graph = context_graph
        first = _Prefix(s=0.0, ns=NEG_INF, v_s=0.0, v_ns=0.0)
        first.has_ctx = True
        self.hyps: list[tuple[tuple[int, ...], _Prefix]] = [((), first)]

    def step(self, log_probs: Any) -> None:
        import torch

        lp = torch.as_tensor(log_probs)
        if lp.shape[0] == 0:
            return
        k = min(self.beam_size, lp.shape[-1])
        top_v, top_i = lp.topk(k, dim=-1)
        for vals, idxs in zip(top_v.tolist(), top_i.tolist(), strict=True):
            self._frame(vals, idxs, self.frame)
            self.frame += 1

    def _frame(self, vals: list[float], idxs: list[int], t: int) -> None:
        blank = self.blank
        graph = self.context_graph
        nxt: dict[tuple[int, ...], _Prefix] = {}

        def get(p: tuple[int, ...]) -> _Prefix:
            s = nxt.get(p)
            if s is None:
                s = nxt[p] = _Prefix()
            return s

        for prob, u in zip(vals, idxs, strict=True):
            for prefix, ps in self.hyps:
                last = prefix[-1] if prefix else None
                if u == blank:
                    ns = get(prefix)
                    ns.s = log_add(ns.s, ps.score() + prob)
                    ns.v_s = ps.viterbi_score() + prob
                    ns.times_s = ps.times().copy()
                    ns.lp_s = ps.lps().copy()
                    if graph is not None:
                        _same_context(ns, ps)
                elif u == last:
                    n1 = get(prefix)  # *uu -> *u
                    if graph is not None:
                        _same_context(n1, ps)
                    n1.ns = log_add(n1.ns, ps.ns + prob)
                    if n1.v_ns < ps.v_ns + prob:
                        n1.v_ns = ps.v_ns + prob
                        if n1.cur_token_prob < prob:
                            n1.cur_token_prob = prob
                            n1.times_ns = ps.times_ns.copy()
                            n1.times_ns[-1] = t
                            n1.lp_ns = ps.lp_ns.copy()
                            n1.lp_ns[-1] = prob
                    n_prefix = prefix + (u,)  # *u-u -> *uu
                    n2 = get(n_prefix)
                    if graph is not None:
                        _next_context(graph, n2, ps, u)
                    n2.ns = log_add(n2.ns, ps.s + prob)
                    if n2.v_ns < ps.v_s + prob:
                        n2.v_ns = ps.v_s + prob
                        n2.cur_token_prob = prob
                        n2.times_ns = ps.times_s.copy()
                        n2.times_ns.append(t)
                        n2.lp_ns = ps.lp_s.copy()
                        n2.lp_ns.append(prob)
                else:
                    n_prefix = prefix + (u,)
                    n = get(n_prefix)
                    if graph is not None:
                        _next_context(graph, n, ps, u)
                    n.ns = log_add(n.ns, ps.score() + prob)
                    if n.v_ns < ps.viterbi_score() + prob:
                        n.v_ns = ps.viterbi_score() + prob
                        n.cur_token_prob = prob
                        n.times_ns = ps.times().copy()
                        n.times_ns.append(t)
                        n.lp_ns = ps.lps().copy()
                        n.lp_ns.append(prob)
        if graph is None:
            ranked = sorted(nxt.items(), key=lambda x: x[1].score(), reverse=True)
        else:  # WeNet's total_score: acoustic + hotword bonus
            ranked = sorted(nxt.items(), key=lambda x: x[1].score() + x[1].ctx, reverse=True)
        self.hyps = ranked[: self.beam_size]

    def nbest(self) -> list[CTCHypothesis]:
        graph = self.context_graph
        if graph is None:
            return [
                CTCHypothesis(list(p), s.score(), list(s.times()), list(s.lps())) for p, s in self.hyps
            ]
        out = [CTCHypothesis(list(p), s.score() + s.ctx + graph.finalize(s.cstate), list(s.times()),
                             list(s.lps())) for p, s in self.hyps]  # fmt: skip
        return sorted(out, key=lambda h: h.score, reverse=True)

    def best(self) -> CTCHypothesis:
        return self.nbest()[0]


def _same_context(n: _Prefix, ps: _Prefix) -> None:
    if not n.has_ctx:
        n.ctx, n.cstate, n.has_ctx = ps.ctx, ps.cstate, True


def _next_context(graph: Any, n: _Prefix, ps: _Prefix, token: int) -> None:
    if not n.has_ctx:
        bonus, n.cstate = graph.step(ps.cstate, token)
        n.ctx, n.has_ctx = ps.ctx + bonus, True


def ctc_prefix_beam_search(log_probs: Any, lengths: Sequence[int] | Any | None = None,
                           beam_size: int = 10, blank: int = 0,
                           context_graphs: Sequence[Any] | None = None) -> list[list[CTCHypothesis]]:
    """n-best lists (best first) for each item of a (B, T, V) batch (or one (T, V) input);
    ``context_graphs``: a hotword graph (or ``None``) per item."""
    import torch

    lp = torch.as_tensor(log_probs)
    if lp.dim() == 2:
        lp = lp.unsqueeze(0)
    lens = [lp.shape[1]] * lp.shape[0] if lengths is None else [int(n) for n in lengths]
    out = []
    for b in range(lp.shape[0]):
        search = CTCPrefixBeamSearch(beam_size, blank,
                                     None if context_graphs is None else context_graphs[b])
        search.step(lp[b, : lens[b]])
        out.append(search.nbest())
    return out


# -- attention rescoring ---------------------------------------------------------------------------


def build_rescoring_inputs(hyps: Sequence[Sequence[int]], sos: int, eos: int,
                           pad: int | None = None) -> tuple[Any, Any, Any]:
    """Decoder inputs for rescoring ``hyps`` (N token lists): ``(l2r, r2l, lengths)``, where
    ``l2r`` = ``[sos, y1 .. yn]`` and ``r2l`` = ``[sos, yn .. y1]`` padded with ``eos`` (or
    ``pad``) to (N, max_len + 1) long tensors; ``lengths`` = n + 1 per hypothesis."""
    import torch

    pad = eos if pad is None else pad
    n = len(hyps)
    width = max((len(h) for h in hyps), default=0) + 1
    l2r = torch.full((n, width), pad, dtype=torch.long)
    r2l = torch.full((n, width), pad, dtype=torch.long)
    l2r[:, 0] = sos
    r2l[:, 0] = sos
    for i, h in enumerate(hyps):
        if h:
            t = torch.as_tensor(list(h), dtype=torch.long)
            l2r[i, 1 : 1 + len(h)] = t
            r2l[i, 1 : 1 + len(h)] = t.flip(0)
    lengths = torch.tensor([len(h) + 1 for h in hyps], dtype=torch.long)
    return l2r, r2l, lengths


@dataclass
class RescoringResult:
    best_index: int
    scores: list[float]  # combined score per hypothesis
    confidences: list[float]  # exp(decoder score / (n + 1)) per hypothesis
    token_confidences: list[list[float]]  # decoder token probabilities (l2r and r2l averaged)


def attention_rescoring(
    hyps: Sequence[Sequence[int]],
    ctc_scores: Sequence[float],
    l2r_log_probs: Any,
    r2l_log_probs: Any | None = None,
    *,
    eos: int,
    ctc_weight: float = 0.5,
    reverse_weight: float = 0.0,
) -> RescoringResult:
    """U2/U2++ attention rescoring of an n-best list.

    ``l2r_log_probs`` (N, L, V): log-softmax of the left-to-right decoder run on
    :func:`build_rescoring_inputs`' ``l2r``; ``r2l_log_probs`` the same for the right-to-left
    decoder on ``r2l`` (U2++; ignored when ``reverse_weight`` is 0). Per hypothesis
    ``y1..yn``: ``att = sum_j l2r[j, y_j] + l2r[n, eos]``; with a reverse decoder
    ``att = (1 - rw) att + rw (sum_j r2l[n-1-j, y_j] + r2l[n, eos])``; the score is
    ``att + ctc_weight * ctc_score``; the first maximum wins (WeNet's rule)."""
    l2r = _as_list3(l2r_log_probs, hyps, eos)
    use_r = reverse_weight > 0 and r2l_log_probs is not None
    r2l = _as_list3(r2l_log_probs, hyps, eos) if use_r else None
    best, best_index = NEG_INF, 0
    scores, confs, tconfs = [], [], []
    for i, hyp in enumerate(hyps):
        row = l2r[i]
        score = 0.0
        tc = []
        for j, w in enumerate(hyp):
            s = row[j][w]
            score += s
            tc.append(math.exp(s))
        score += row[len(hyp)][eos]
        if r2l is not None:
            rrow = r2l[i]
            r_score = 0.0
            n = len(hyp)
            for j, w in enumerate(hyp):
                s = rrow[n - j - 1][w]
                r_score += s
                tc[j] = (tc[j] + math.exp(s)) / 2
            r_score += rrow[n][eos]
            score = score * (1 - reverse_weight) + r_score * reverse_weight
        confs.append(math.exp(score / (len(hyp) + 1)))
        score += ctc_scores[i] * ctc_weight
        scores.append(score)
        tconfs.append(tc)
        if score > best:
            best, best_index = score, i
    return RescoringResult(best_index, scores, confs, tconfs)


def _as_list3(x: Any, hyps: Sequence[Sequence[int]], eos: int) -> list[list[dict[int, float]]]:
    """Gather only the needed entries (one per token + eos) into nested Python lists."""
    import torch

    t = torch.as_tensor(x)
    out = []
    for i, hyp in enumerate(hyps):
        n = len(hyp)
        ids = list(hyp) + [eos]
        pos = torch.arange(n + 1)
        vals = t[i, pos, torch.as_tensor(ids, dtype=torch.long)].double().tolist()
        # row[j][w] look-ups: positions j for token j (l2r), reversed positions for r2l need
        # every (position, token) pair of the hypothesis, so keep a dict per position
        rows: list[dict[int, float]] = [dict() for _ in range(n + 1)]
        for j in range(n + 1):
            rows[j][ids[j]] = vals[j]
        if n:
            # the reverse look-up reads position n-1-j for token j
            rpos = torch.arange(n - 1, -1, -1)
            rv = t[i, rpos, torch.as_tensor(list(hyp), dtype=torch.long)].double().tolist()
            for j, w in enumerate(hyp):
                rows[n - 1 - j][w] = rv[j]
        out.append(rows)
    return out


# -- timestamps ------------------------------------------------------------------------------------


@dataclass
class TokenTiming:
    token: int
    start: float
    end: float
    confidence: float


def token_timestamps(
    tokens: Sequence[int],
    times: Sequence[int],
    confidences: Sequence[float],
    *,
    frame_shift: float,
    num_frames: int | None = None,
    offset: float = 0.0,
    max_token_duration: float = 1.0,
) -> list[TokenTiming]:
    """Token start/end in seconds from CTC peak frames.

    A token is centred on its peak: it starts half way between the previous peak and its own
    (the audio start for the first token) and ends half way to the next peak (the end of the
    audio, ``num_frames``, for the last token), both clipped to ``max_token_duration / 2`` around
    the peak, so long silences are not given to a token. ``frame_shift`` is seconds per encoder
    frame; ``offset`` is added to every time."""
    n = len(tokens)
    out: list[TokenTiming] = []
    half = max_token_duration / 2
    total = None if num_frames is None else num_frames * frame_shift
    for i in range(n):
        peak = (times[i] + 0.5) * frame_shift
        prev = 0.0 if i == 0 else (times[i - 1] + 0.5) * frame_shift
        nxt = ((times[i + 1] + 0.5) * frame_shift) if i + 1 < n else (total if total is not None else peak + half)
        start = max(peak - half, (prev + peak) / 2 if i else max(0.0, peak - half))
        end = min(peak + half, (peak + nxt) / 2 if i + 1 < n else nxt)
        end = max(end, start)
        out.append(TokenTiming(int(tokens[i]), round(start + offset, 3), round(end + offset, 3),
                               float(confidences[i])))
    return out


def _is_cjk(ch: str) -> bool:
    o = ord(ch)
    return (
        0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x3040 <= o <= 0x30FF
        or 0xAC00 <= o <= 0xD7AF or 0xF900 <= o <= 0xFAFF or 0x20000 <= o <= 0x2A6DF
    )


def group_words(pieces: Sequence[str], timings: Sequence[TokenTiming],
                word_boundary: str = "\u2581") -> list[tuple[str, float, float, float]]:
    """Group token pieces into words: a piece starting with ``word_boundary`` ("▁",
    sentencepiece) or a space starts a new word; a CJK character is a word by itself; other
    pieces continue the current word. Returns (word, start, end, confidence) with the word's
    confidence the mean of its tokens'."""
    words: list[list[Any]] = []  # [text, start, end, [confs], open]
    for piece, tm in zip(pieces, timings, strict=True):
        text = piece
        new_word = False
        if text.startswith(word_boundary) or text.startswith(" "):
            text = text.lstrip(word_boundary + " ")
            new_word = True
        cjk = bool(text) and all(_is_cjk(c) for c in text)
        if not text:
            continue
        if cjk or new_word or not words or not words[-1][4]:
            words.append([text, tm.start, tm.end, [tm.confidence], not cjk])
        else:
            w = words[-1]
            w[0] += text
            w[2] = tm.end
            w[3].append(tm.confidence)
    return [(w[0], w[1], w[2], sum(w[3]) / len(w[3])) for w in words]

"""Beam search for token-and-duration transducers (TDT), over a family's
:class:`~oasr.decoders.transducer.TransducerNetwork` (the joiner gives token logits followed by
one logit per allowed duration, as for :class:`~oasr.decoders.transducer.TDTGreedySearch`).

Hypotheses carry their own time pointer (a TDT hypothesis may jump several frames). The search
repeatedly takes the earliest pointer ``t`` among the live hypotheses and expands every hypothesis
at ``t``: each (token, duration) pair scores ``log_softmax(token logits)[u] +
log_softmax(duration logits)[d]``; blank moves the pointer ``max(d, 1)`` frames (as greedy
does), a token is emitted at ``t`` with duration ``d`` and moves it ``d`` frames (after
``max_symbols_per_frame`` tokens at one frame a duration of 0 moves it one frame, as greedy). The
new hypotheses and those waiting at later frames are pooled, equal (token sequence, pointer) pairs
merged by log-add, and the ``beam_size`` best kept, until every pointer passed the last frame
(NeMo's TDT beam search keeps hypotheses at different frames in one beam the same way). With
``beam_size=1`` this is exactly the greedy search (the best pair is the greedy token and the
greedy duration). The result ranks by ``score / (len(tokens) + 1)`` (``length_norm``) or by score.

Utterances are searched one after another; the hypotheses of one utterance share each joiner and
prediction-network call. torch is imported when a search runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from oasr.decoders.hypothesis import Hypothesis
from oasr.decoders.transducer import (
    TransducerNetwork,
    _advance_rows,
    _batch,
    _check_positive,
    _log_add,
    _start,
)
from oasr.errors import CheckpointError

__all__ = ["tdt_beam_search"]


class _Hyp:
    __slots__ = ("tokens", "score", "times", "durations", "logprobs", "time", "run", "row")

    def __init__(self, tokens: tuple[int, ...], score: float, times: list[int], durations: list[int],
                 logprobs: list[float], time: int, run: int, row: int) -> None:
        self.tokens, self.score, self.times, self.durations = tokens, score, times, durations
        self.logprobs, self.time, self.run, self.row = logprobs, time, run, row


def _add(pool: dict, h: _Hyp, parent_row: int, token: int) -> None:
    """Pool a new hypothesis; an equal (token sequence, pointer) one already there absorbs it
    (log-add of the scores)."""
    key = (h.tokens, h.time)
    same = pool.get(key)
    if same is not None:
        same[0].score = _log_add(same[0].score, h.score)
        return
    pool[key] = (h, parent_row, token)


def tdt_beam_search(network: TransducerNetwork, encoder_out: Any,
                    lengths: Sequence[int] | Any | None = None, *, durations: Sequence[int],
                    blank_id: int, beam_size: int = 4, max_symbols_per_frame: int = 10,
                    length_norm: bool = True) -> list[list[Hypothesis]]:
    """n-best lists (best first) of each utterance of a (B, T, D) batch (or one (T, D) input) of
    encoder frames in the form ``network.join`` takes them. See the module docstring."""
    enc, lens = _batch(encoder_out, lengths)
    _check_positive(beam_size, "beam_size")
    _check_positive(max_symbols_per_frame, "max_symbols_per_frame")
    durs = [int(d) for d in durations]
    if not durs or min(durs) < 0:
        raise CheckpointError(f"TDT durations must be a non-empty list of frame counts >= 0, got "
                              f"{durations!r}")
    return [_search_one(network, enc[b, :n], durs, blank_id, int(beam_size),
                        int(max_symbols_per_frame), length_norm) for b, n in enumerate(lens)]


def _search_one(network: TransducerNetwork, enc: Any, durations: list[int], blank_id: int,
                beam: int, max_symbols: int, length_norm: bool) -> list[Hypothesis]:
    import torch

    frames = enc.shape[0]
    device = enc.device
    hyps = [_Hyp((), 0.0, [], [], [], 0, 0, 0)]
    if frames == 0:
        return [Hypothesis(tokens=[])]
    with torch.no_grad():
        state, decoder_out = _start(network, 1, blank_id, device)
        n_dur = len(durations)
        while True:
            live = [h for h in hyps if h.time < frames]
            if not live:
                break
            t = min(h.time for h in live)
            expand = [h for h in hyps if h.time == t]
            rows = torch.as_tensor([h.row for h in expand], dtype=torch.long, device=device)
            logits = network.join(enc[t].unsqueeze(0).expand(len(expand), -1),
                                  decoder_out[rows]).float()
            n_tok = logits.shape[-1] - n_dur
            if n_tok <= blank_id:
                raise CheckpointError(
                    f"the joiner gives {logits.shape[-1]} logits, too few for blank id {blank_id} "
                    f"and {n_dur} durations; check the TDT durations and the vocabulary size")
            tok_lp = logits[:, :n_tok].log_softmax(-1)
            dur_lp = logits[:, n_tok:].log_softmax(-1)
            pair = (tok_lp[:, :, None] + dur_lp[:, None, :]).view(len(expand), -1)
            k = min(beam, pair.shape[1])
            top_v, top_i = pair.topk(k, dim=-1)
            tok_of = torch.div(top_i, n_dur, rounding_mode="floor")
            dur_of = top_i % n_dur
            tok_scores = tok_lp.gather(1, tok_of)
            pool: dict[tuple[tuple[int, ...], int], tuple[_Hyp, int, int]] = {}

            def add(h: _Hyp, parent_row: int, token: int, pool=pool) -> None:  # noqa: ANN001
                _add(pool, h, parent_row, token)

            for h in hyps:  # hypotheses waiting at later frames stay as they are
                if h.time != t:
                    add(_Hyp(h.tokens, h.score, h.times, h.durations, h.logprobs, h.time, h.run,
                             h.row), h.row, -1)
            for j, h in enumerate(expand):
                for v, u, di, lp in zip(top_v[j].tolist(), tok_of[j].tolist(), dur_of[j].tolist(),
                                        tok_scores[j].tolist(), strict=True):
                    d = durations[di]
                    score = h.score + v
                    if u == blank_id:
                        add(_Hyp(h.tokens, score, h.times, h.durations, h.logprobs,
                                 t + max(d, 1), 0, h.row), h.row, -1)
                        continue
                    run = h.run + 1
                    nxt = t + d
                    if d == 0 and run >= max_symbols:
                        nxt = t + 1
                    add(_Hyp(h.tokens + (u,), score, h.times + [t], h.durations + [d],
                             h.logprobs + [lp], nxt, run if nxt == t else 0, h.row), h.row, u)
            ranked = sorted(pool, key=lambda key: pool[key][0].score, reverse=True)[:beam]
            parents, emitted, new_hyps = [], [], []
            for pos, key in enumerate(ranked):
                h, parent_row, token = pool[key]
                h.row = pos
                parents.append(parent_row)
                if token >= 0:
                    emitted.append((pos, token))
                new_hyps.append(h)
            index = torch.as_tensor(parents, dtype=torch.long, device=device)
            state = network.select_state(state, index)
            decoder_out = decoder_out[index]
            if emitted:
                state, decoder_out = _advance_rows(network, state, decoder_out,
                                                   [p for p, _ in emitted], [u for _, u in emitted])
            hyps = new_hyps

    def rank(h: _Hyp) -> float:
        return h.score / (len(h.tokens) + 1) if length_norm else h.score

    return [Hypothesis(list(h.tokens), h.score, list(h.times), list(h.logprobs), list(h.durations))
            for h in sorted(hyps, key=rank, reverse=True)]


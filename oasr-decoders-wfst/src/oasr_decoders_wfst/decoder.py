"""Token-passing beam search over a WFST graph image, batched over utterances and streaming.

The search is Kaldi's ``FasterDecoder`` (the one kaldi-decoder ships), restated as whole-array
PyTorch operations so that it runs on the GPU (any torch device; CUDA is the fast path) for many
utterances at once. Per frame and utterance:

1. cutoff: ``best + beam``, or the ``max_active``-th best cost when that is tighter, or the
   ``min_active``-th when that is looser (the adaptive beam then follows ``beam_delta``);
2. emitting arcs (input label != 0) of every token under the cutoff consume the frame: cost +
   arc weight - scaled log-prob of the arc's token; candidates at or above ``best new +
   adaptive beam`` are dropped; per (utterance, state) the cheapest survives (scatter-min);
3. epsilon closure: input-epsilon arcs are followed from tokens at or under that cutoff, until
   no state's best cost improves (a frontier per round).

Tokens are flat arrays (utterance, state, cost, back-pointer) over the whole batch, so one set
of kernels serves every utterance. A back-pointer names the last *word record* on the token's
path (word, frame, previous record), appended only when an arc with a word output survives:
traceback follows records, not per-frame tokens. Costs are float64 (Kaldi's token costs are
doubles); arc weights and log-probs float32, summed in Kaldi's order.

Streaming: :meth:`WfstDecoder.init_state` / :meth:`advance` (any number of frames per call, per
utterance) / :meth:`finalize`; the active tokens and the records stay in the state between
calls, so a stream decoded chunk by chunk gives exactly the offline result.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from oasr.defaults import env_switch
from oasr.errors import InvalidRequestError
from oasr_decoders_wfst.graph import WfstGraph

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class WfstSearchOptions:
    """Kaldi FasterDecoder options, plus the acoustic scale applied to the log-probs."""

    beam: float = 16.0
    max_active: int = INT32_MAX
    min_active: int = 20
    beam_delta: float = 0.5
    acoustic_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.beam > 0:
            raise InvalidRequestError("beam must be > 0", param="beam")
        if self.max_active < 1:
            raise InvalidRequestError("max_active must be >= 1", param="max_active")
        if not 0 <= self.min_active <= self.max_active:
            raise InvalidRequestError("min_active must be in 0..max_active", param="min_active")
        if not self.acoustic_scale > 0:
            raise InvalidRequestError("acoustic_scale must be > 0", param="acoustic_scale")


@dataclass
class WfstHypothesis:
    """One-best path of one utterance. ``word_frames[i]``: the frame of the arc that output
    word ``i`` (an epsilon arc counts as the last frame consumed before it)."""

    words: list[str]
    word_ids: list[int]
    word_frames: list[int]
    cost: float
    reached_final: bool
    num_frames: int

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class _Tokens:
    utt: torch.Tensor  # int64 [N]
    state: torch.Tensor  # int64 [N]
    cost: torch.Tensor  # float64 [N]
    rec: torch.Tensor  # int64 [N], -1: no word yet

    def select(self, idx: torch.Tensor) -> _Tokens:
        return _Tokens(self.utt[idx], self.state[idx], self.cost[idx], self.rec[idx])

    @staticmethod
    def cat(parts: Sequence[_Tokens]) -> _Tokens:
        return _Tokens(*(torch.cat([getattr(p, f) for p in parts]) for f in ("utt", "state", "cost", "rec")))


@dataclass
class WfstDecodeState:
    """What a batch of streams carries between :meth:`WfstDecoder.advance` calls."""

    batch_size: int
    tokens: _Tokens
    frames: torch.Tensor  # int64 [B] frames consumed per utterance (CPU)
    rec_prev: torch.Tensor
    rec_word: torch.Tensor
    rec_frame: torch.Tensor
    num_records: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class _Csr:
    """Arcs of one kind (emitting or epsilon) as CSR tensors on the device."""

    def __init__(self, graph: WfstGraph, mask: np.ndarray, device: torch.device) -> None:
        counts = np.bincount(np.repeat(np.arange(graph.num_states), np.diff(graph.state_offsets))[mask],
                             minlength=graph.num_states)  # fmt: skip
        off = np.zeros(graph.num_states + 1, dtype=np.int64)
        np.cumsum(counts, out=off[1:])
        self.offsets = torch.from_numpy(off).to(device)
        self.next = torch.from_numpy(graph.next_states[mask].astype(np.int64)).to(device)
        self.token = torch.from_numpy(graph.ilabels[mask].astype(np.int64) - 1).to(device)
        self.olabel = torch.from_numpy(graph.olabels[mask].astype(np.int64)).to(device)
        self.weight = torch.from_numpy(graph.weights[mask].astype(np.float64)).to(device)
        self.num_arcs = int(mask.sum())

    def expand(self, states: torch.Tensor,
               mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(index of the token, arc id) for every arc leaving ``states`` (where ``mask``)."""
        start = self.offsets[states]
        deg = self.offsets[states + 1] - start
        if mask is not None:
            deg = torch.where(mask, deg, torch.zeros_like(deg))
        total = int(deg.sum())
        if total == 0:
            empty = torch.empty(0, dtype=torch.int64, device=states.device)
            return empty, empty
        owner = torch.repeat_interleave(torch.arange(states.numel(), device=states.device), deg,
                                        output_size=total)  # fmt: skip
        first = torch.cumsum(deg, 0) - deg
        arc = start[owner] + torch.arange(total, device=states.device) - first[owner]
        return owner, arc


def state_of(parts: list[tuple[torch.Tensor, ...]], idx: torch.Tensor) -> torch.Tensor:
    """States of flat token indices ``idx`` over the concatenation of ``parts``."""
    return torch.cat([p[1] for p in parts])[idx]


class WfstDecoder:
    """Beam search over one graph on one device; decode many utterances per call."""

    _fused_broken = False  # set once the fused kernel failed in this process

    def __init__(self, graph: WfstGraph, device: str | torch.device = "cpu",
                 options: WfstSearchOptions | None = None) -> None:  # fmt: skip
        self.graph = graph
        self.device = torch.device(device)
        self.options = options or WfstSearchOptions()
        emitting = graph.ilabels != 0
        self.emit = _Csr(graph, emitting, self.device)
        self.eps = _Csr(graph, ~emitting, self.device)
        self.final = torch.from_numpy(graph.final_weights.astype(np.float64)).to(self.device)
        self.num_states = graph.num_states
        self.num_tokens = graph.num_tokens
        self._scratch_size = 0

    # ----------------------------------------------------------------------------- scratch
    def _scratch(self, batch: int) -> None:
        size = batch * self.num_states
        if size > self._scratch_size:
            self._best = torch.full((size,), math.inf, dtype=torch.float64, device=self.device)
            self._win = torch.full((size,), INT32_MAX * 4, dtype=torch.int64, device=self.device)
            self._slot = torch.full((size,), -1, dtype=torch.int64, device=self.device)
            self._scratch_size = size

    def _argmin_by_key(self, key: torch.Tensor, cost: torch.Tensor,
                       finite_only: bool = False) -> torch.Tensor:  # fmt: skip
        """Indices of the cheapest entry per key (the first on ties); with ``finite_only``
        keys whose cheapest is ``inf`` have none. Scratch left clean."""
        best, win = self._best, self._win
        best.scatter_reduce_(0, key, cost, "amin")
        idx = torch.arange(key.numel(), device=key.device)
        at_min = cost == best[key]
        win.scatter_reduce_(0, torch.where(at_min, key, torch.zeros_like(key)),
                            torch.where(at_min, idx, torch.full_like(idx, INT32_MAX * 4)), "amin")  # fmt: skip
        chosen_mask = win[key] == idx
        if finite_only:
            chosen_mask &= torch.isfinite(cost)
        chosen = torch.nonzero(chosen_mask).squeeze(1)
        best[key] = math.inf
        win[key] = INT32_MAX * 4
        return chosen

    # ----------------------------------------------------------------------------- records
    def _add_records(self, st: WfstDecodeState, prev: torch.Tensor, word: torch.Tensor,
                     frame: torch.Tensor) -> torch.Tensor:  # fmt: skip
        n = prev.numel()
        need = st.num_records + n
        if need > st.rec_prev.numel():
            cap = max(need, 2 * st.rec_prev.numel(), 1024)
            for name in ("rec_prev", "rec_word", "rec_frame"):
                old = getattr(st, name)
                new = torch.empty(cap, dtype=old.dtype, device=old.device)
                new[: st.num_records] = old[: st.num_records]
                setattr(st, name, new)
        sl = slice(st.num_records, need)
        st.rec_prev[sl] = prev
        st.rec_word[sl] = word
        st.rec_frame[sl] = frame
        ids = torch.arange(st.num_records, need, device=self.device)
        st.num_records = need
        return ids

    # ----------------------------------------------------------------------------- search
    def init_state(self, batch_size: int) -> WfstDecodeState:
        """Fresh streams: one token per utterance at the start state, epsilon-closed."""
        dev = self.device
        self._scratch(batch_size)
        tokens = _Tokens(
            utt=torch.arange(batch_size, device=dev),
            state=torch.full((batch_size,), self.graph.start, dtype=torch.int64, device=dev),
            cost=torch.zeros(batch_size, dtype=torch.float64, device=dev),
            rec=torch.full((batch_size,), -1, dtype=torch.int64, device=dev),
        )
        empty = torch.empty(0, dtype=torch.int64, device=dev)
        st = WfstDecodeState(batch_size, tokens, torch.zeros(batch_size, dtype=torch.int64),
                             empty, empty.clone(), empty.clone())  # fmt: skip
        cutoff = torch.full((batch_size,), math.inf, dtype=torch.float64, device=dev)
        st.tokens = self._epsilon_closure(st, st.tokens, cutoff, torch.zeros(batch_size, dtype=torch.int64, device=dev))
        return st

    def _cutoff(self, tok: _Tokens, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Kaldi's GetCutoff per utterance: (weight cutoff, adaptive beam)."""
        o = self.options
        dev = self.device
        best = torch.full((batch,), math.inf, dtype=torch.float64, device=dev)
        best.scatter_reduce_(0, tok.utt, tok.cost, "amin")
        beam_cut = best + o.beam
        adaptive = torch.full((batch,), o.beam, dtype=torch.float64, device=dev)
        if o.max_active == INT32_MAX and o.min_active == 0:
            return beam_cut, adaptive
        count = torch.bincount(tok.utt, minlength=batch)
        order = torch.argsort(tok.cost, stable=True)
        order = order[torch.argsort(tok.utt[order], stable=True)]
        sorted_cost = tok.cost[order]
        start = torch.cumsum(count, 0) - count
        n = sorted_cost.numel()

        def kth(k: int) -> torch.Tensor:
            idx = (start + k).clamp(max=max(n - 1, 0))
            val = sorted_cost[idx] if n else torch.full_like(best, math.inf)
            return torch.where(count > k, val, torch.full_like(val, math.inf))

        max_cut = kth(o.max_active) if o.max_active < n else torch.full_like(best, math.inf)
        use_max = max_cut < beam_cut
        if o.min_active == 0:
            min_cut = torch.where(count > 0, best, torch.full_like(best, math.inf))
        else:
            min_cut = kth(o.min_active)
        use_min = ~use_max & (min_cut > beam_cut)
        cutoff = torch.where(use_max, max_cut, torch.where(use_min, min_cut, beam_cut))
        adaptive = torch.where(use_max, max_cut - best + o.beam_delta,
                               torch.where(use_min, min_cut - best + o.beam_delta, adaptive))  # fmt: skip
        # Kaldi keeps the adaptive beam in a float
        return cutoff, adaptive.to(torch.float32).to(torch.float64)

    def _emitting(self, st: WfstDecodeState, tok: _Tokens, scaled: torch.Tensor,
                  frame: torch.Tensor) -> tuple[_Tokens, torch.Tensor]:  # fmt: skip
        """One frame for the tokens of utterances that have it; ``scaled`` [B, V] float32."""
        batch = st.batch_size
        cutoff, adaptive = self._cutoff(tok, batch)
        live = tok
        owner, arc = self.emit.expand(tok.state, tok.cost < cutoff[tok.utt])
        utt = live.utt[owner]
        ac_cost = -scaled[utt, self.emit.token[arc]]
        new_cost = (live.cost[owner] + self.emit.weight[arc]) + ac_cost.to(torch.float64)
        best_new = torch.full((batch,), math.inf, dtype=torch.float64, device=self.device)
        best_new.scatter_reduce_(0, utt, new_cost, "amin")
        next_cutoff = best_new + adaptive
        # candidates at or above the cutoff lose; the cheapest per (utterance, state) wins
        new_cost = torch.where(new_cost < next_cutoff[utt], new_cost,
                               torch.full_like(new_cost, math.inf))  # fmt: skip
        dest = self.emit.next[arc]
        win = self._argmin_by_key(utt * self.num_states + dest, new_cost, finite_only=True)
        owner, arc, utt, new_cost, dest = owner[win], arc[win], utt[win], new_cost[win], dest[win]
        rec = live.rec[owner]
        olab = self.emit.olabel[arc]
        with_word = torch.nonzero(olab != 0).squeeze(1)
        if with_word.numel():
            rec[with_word] = self._add_records(st, rec[with_word], olab[with_word],
                                               frame[utt[with_word]])  # fmt: skip
        return _Tokens(utt, dest, new_cost, rec), next_cutoff

    def _epsilon_closure(self, st: WfstDecodeState, tok: _Tokens, cutoff: torch.Tensor,
                         frame: torch.Tensor) -> _Tokens:  # fmt: skip
        """Follow input-epsilon arcs until no (utterance, state) improves; tokens above the
        cutoff are not expanded and candidates above it are dropped (Kaldi's
        ProcessNonemitting). A token that improves is appended anew and its old entry marked
        dead (no in-place scatter, so each round costs two host syncs)."""
        if self.eps.num_arcs == 0 or tok.utt.numel() == 0:
            return tok
        S = self.num_states
        slot = self._slot
        dev = self.device
        utt, state, cost, rec = tok.utt, tok.state, tok.cost, tok.rec
        alive = [torch.ones(utt.numel() + 1, dtype=torch.bool, device=dev)]  # + a sentinel
        parts = [(utt, state, cost, rec)]
        n_total = utt.numel()
        slot[utt * S + state] = torch.arange(n_total, device=dev)
        # all tokens of the current set, as flat tensors (rebuilt lazily after each round)
        all_cost, all_rec, all_utt = cost, rec, utt
        frontier = None  # first round: every token at or under the cutoff
        rounds = 0
        while frontier is None or frontier.numel():
            rounds += 1
            if frontier is None:
                owner, arc = self.eps.expand(state, cost <= cutoff[utt])
            else:
                owner, arc = self.eps.expand(state_of(parts, frontier))
            if owner.numel() == 0:
                break
            src = owner if frontier is None else frontier[owner]
            c_utt = all_utt[src]
            c_cost = all_cost[src] + self.eps.weight[arc]
            dest = self.eps.next[arc]
            key = c_utt * S + dest
            existing = slot[key]
            current = torch.where(existing >= 0, all_cost[existing.clamp(min=0)],
                                  torch.full_like(c_cost, math.inf))  # fmt: skip
            ok = (c_cost <= cutoff[c_utt]) & (c_cost < current)
            c_cost = torch.where(ok, c_cost, torch.full_like(c_cost, math.inf))
            win = self._argmin_by_key(key, c_cost, finite_only=True)
            if win.numel() == 0:
                break
            src, arc, c_utt, c_cost, dest, key, existing = (
                x[win] for x in (src, arc, c_utt, c_cost, dest, key, existing))
            n_new = win.numel()
            olab = self.eps.olabel[arc]
            c_rec = all_rec[src]
            # one record per new token (word 0 = none): no count to read back
            c_rec = torch.where(olab != 0, self._add_records(st, c_rec, olab, frame[c_utt]), c_rec)
            # the improved tokens die; the sentinel slot takes the writes of new states
            dead_at = torch.where(existing >= 0, existing, torch.full_like(existing, n_total))
            flat_alive = torch.cat(alive)
            flat_alive[dead_at] = False
            new_idx = torch.arange(n_total, n_total + n_new, device=dev)
            slot[key] = new_idx
            parts.append((c_utt, dest, c_cost, c_rec))
            alive = [flat_alive[:n_total], torch.ones(n_new + 1, dtype=torch.bool, device=dev)]
            n_total += n_new
            all_utt = torch.cat([all_utt, c_utt])
            all_cost = torch.cat([all_cost, c_cost])
            all_rec = torch.cat([all_rec, c_rec])
            frontier = new_idx
        all_state = torch.cat([p[1] for p in parts])
        slot[all_utt * S + all_state] = -1
        if rounds <= 1 and len(parts) == 1:
            return tok
        keep = torch.nonzero(torch.cat(alive)[:n_total]).squeeze(1)
        return _Tokens(all_utt[keep], all_state[keep], all_cost[keep], all_rec[keep])

    def _check_input(self, log_probs: torch.Tensor, lengths: Any) -> None:
        if log_probs.dim() != 3 or log_probs.shape[2] != self.num_tokens:
            raise InvalidRequestError(f"log_probs must be [batch, frames, {self.num_tokens} "
                                      f"tokens], got {tuple(log_probs.shape)}")  # fmt: skip
        if lengths is not None:
            lens = torch.as_tensor(lengths, dtype=torch.int64).cpu()
            B, T = log_probs.shape[:2]
            if lens.numel() != B or bool((lens < 0).any()) or bool((lens > T).any()):
                raise InvalidRequestError(f"lengths must be {B} values in 0..{T}")

    def advance(self, st: WfstDecodeState, log_probs: torch.Tensor,
                lengths: Sequence[int] | torch.Tensor | None = None) -> None:  # fmt: skip
        """Consume ``log_probs`` [B, T, V] (CTC log-probabilities, blank at 0): the first
        ``lengths[b]`` frames of row ``b`` (all by default)."""
        if log_probs.dim() != 3 or log_probs.shape[0] != st.batch_size:
            raise InvalidRequestError(f"log_probs must be [batch={st.batch_size}, frames, "
                                      f"tokens], got {tuple(log_probs.shape)}")  # fmt: skip
        if log_probs.shape[2] != self.num_tokens:
            raise InvalidRequestError(f"log_probs have {log_probs.shape[2]} tokens, the graph "
                                      f"{self.num_tokens}")  # fmt: skip
        B, T = log_probs.shape[:2]
        if lengths is None:
            lens = torch.full((B,), T, dtype=torch.int64)
        else:
            lens = torch.as_tensor(lengths, dtype=torch.int64).cpu()
            if lens.numel() != B or bool((lens < 0).any()) or bool((lens > T).any()):
                raise InvalidRequestError(f"lengths must be {B} values in 0..{T}")
        self._scratch(B)
        scaled = log_probs.to(self.device, torch.float32)
        if self.options.acoustic_scale != 1.0:
            scaled = scaled * self.options.acoustic_scale
        lens_dev = lens.to(self.device)
        frames_dev = st.frames.to(self.device)
        for t in range(int(lens.max()) if B else 0):
            frame = frames_dev + t
            tok = st.tokens
            if bool((lens > t).all()):
                carried = None
                moving = tok
            else:
                on = (lens_dev > t)[tok.utt]
                carried = tok.select(torch.nonzero(~on).squeeze(1))
                moving = tok.select(torch.nonzero(on).squeeze(1))
            new, next_cutoff = self._emitting(st, moving, scaled[:, t], frame)
            new = self._epsilon_closure(st, new, next_cutoff, frame)
            st.tokens = new if carried is None else _Tokens.cat([carried, new])
        st.frames = st.frames + lens

    def finalize(self, st: WfstDecodeState) -> list[WfstHypothesis]:
        """One-best per utterance: the cheapest token with its final cost where any token is
        final (Kaldi's GetBestPath), else the cheapest token."""
        B = st.batch_size
        tok = st.tokens
        dev = self.device
        total = tok.cost + self.final[tok.state]
        final_ok = torch.isfinite(total)
        any_final = torch.zeros(B, dtype=torch.bool, device=dev)
        any_final[tok.utt[final_ok]] = True
        score = torch.where(any_final[tok.utt], total, tok.cost)
        score = torch.where(torch.isfinite(score), score, torch.full_like(score, math.inf))
        order = torch.arange(score.numel(), device=dev)
        self._scratch(B)
        key = tok.utt
        win = self._argmin_by_key(key, score)  # keys are utterance ids here
        best_utt = tok.utt[win]
        best_rec = torch.full((B,), -1, dtype=torch.int64, device=dev)
        best_cost = torch.full((B,), math.inf, dtype=torch.float64, device=dev)
        best_rec[best_utt] = tok.rec[win]
        best_cost[best_utt] = score[win]
        del order
        rec_prev = st.rec_prev[: st.num_records].cpu().numpy()
        rec_word = st.rec_word[: st.num_records].cpu().numpy()
        rec_frame = st.rec_frame[: st.num_records].cpu().numpy()
        out = []
        best_rec_h = best_rec.cpu().tolist()
        best_cost_h = best_cost.cpu().tolist()
        any_final_h = any_final.cpu().tolist()
        frames = st.frames.tolist()
        for b in range(B):
            ids, times = [], []
            r = best_rec_h[b]
            while r >= 0:
                ids.append(int(rec_word[r]))
                times.append(int(rec_frame[r]))
                r = int(rec_prev[r])
            ids.reverse()
            times.reverse()
            out.append(WfstHypothesis([self.graph.words[i] for i in ids], ids, times,
                                      best_cost_h[b], bool(any_final_h[b]), frames[b]))  # fmt: skip
        return out

    def decode(self, log_probs: torch.Tensor, lengths: Sequence[int] | torch.Tensor | None = None,
               fused: bool | None = None) -> list[WfstHypothesis]:  # fmt: skip
        """Offline: the one-best of every row of ``log_probs`` [B, T, V]. ``fused``: run the
        whole search as one CUDA kernel (``oasr_decoders_wfst.fused``); by default on CUDA unless
        ``OASR_WFST_FUSED=0`` (H200, 5000-word graph, 64 x 30 s: 0.083 s against the tensor
        search's 4.9 s, the same words), where a kernel that fails to build or launch warns once
        and falls back to the tensor search; asked for explicitly it raises."""
        explicit = fused is not None
        if fused is None:  # docs/wfst_decoder_gpu.md, "The fused kernel"
            fused = (self.device.type == "cuda" and env_switch("OASR_WFST_FUSED", True)
                     and not WfstDecoder._fused_broken)  # fmt: skip
        if fused:
            from oasr_decoders_wfst.fused import decode_fused

            self._check_input(log_probs, lengths)
            try:
                return decode_fused(self, log_probs, lengths)
            except InvalidRequestError:
                raise
            except Exception as exc:  # numba missing, no CUDA target for this driver, ...
                if explicit or WfstDecoder._fused_broken:
                    raise
                WfstDecoder._fused_broken = True
                warnings.warn(f"the fused WFST kernel is not available here ({exc!r}); using "
                              f"the tensor search", RuntimeWarning, stacklevel=2)  # fmt: skip
        st = self.init_state(log_probs.shape[0])
        self.advance(st, log_probs, lengths)
        return self.finalize(st)

"""Generic transducer decoders: RNN-T greedy search, icefall's modified beam search, and NeMo's
token-and-duration (TDT) greedy search. Batched over utterances, offline or incremental.

A model family reaches its prediction network and joiner only through :class:`TransducerNetwork`
(five small methods), so one search serves icefall's stateless decoder (its "state" is the last
``context_size`` tokens) and NeMo's LSTM prediction network (its state is ``(h, c)``) alike.
Encoder frames are passed in the form ``join`` takes them: a family whose joiner projects the
encoder output projects it once, before the search (icefall ``joiner.encoder_proj``, NeMo
``joint.project_encoder``).

Every search returns :class:`~oasr.decoders.hypothesis.Hypothesis` (the type the CTC decoders
return): ``times`` are the encoder frames at which tokens were emitted, ``token_logprobs`` the
log-probability of each token at its emission (log-softmax over the token logits), so
:func:`oasr.decoders.token_timestamps` and :func:`oasr.decoders.group_words` give word times and
confidences exactly as for CTC. TDT hypotheses also carry ``durations`` (frames per token);
:func:`duration_token_timestamps` turns them into token spans.

Semantics (restated from the references, tested against them):

* greedy (:class:`TransducerGreedySearch`): frame by frame; at a frame the joiner is evaluated
  for the current decoder output, a non-blank argmax is emitted (the prediction network then
  advances) and the same frame is evaluated again, until blank or ``max_symbols_per_frame``
  symbols. ``max_symbols_per_frame=1`` is icefall's ``greedy_search_batch``; larger values are
  icefall's ``greedy_search`` and NeMo's greedy RNN-T decoding (``max_symbols_per_step``).
* modified beam search (:class:`TransducerModifiedBeamSearch`): icefall's
  ``modified_beam_search``; at most one symbol per frame, per frame the ``beam_size`` best
  (hypothesis, token) pairs of each utterance survive, equal token sequences are merged by
  log-add.
* TDT greedy (:class:`TDTGreedySearch`): NeMo's batched greedy TDT (label looping): the joiner
  gives token logits followed by one logit per allowed duration; the token argmax is emitted
  unless blank, the time pointer advances by the argmax duration (at least one frame after a
  blank), and after ``max_symbols_per_frame`` tokens without advancing it is moved one frame.

torch is imported when a search runs, not when this module is imported.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from oasr.decoders.ctc import TokenTiming
from oasr.decoders.hypothesis import Hypothesis
from oasr.errors import CheckpointError, InvalidRequestError

__all__ = [
    "TDTGreedySearch",
    "TransducerGreedySearch",
    "TransducerModifiedBeamSearch",
    "TransducerNetwork",
    "duration_token_timestamps",
    "tdt_greedy_search",
    "transducer_greedy_search",
    "transducer_modified_beam_search",
]


@runtime_checkable
class TransducerNetwork(Protocol):
    """What a family gives the transducer searches: its prediction network and joiner.

    A *state* is whatever the prediction network carries between tokens, for N rows (hypotheses
    or utterances): icefall's stateless decoder keeps the last ``context_size`` tokens (an (N, c)
    long tensor), NeMo's LSTM keeps ``(h, c)`` of shape (layers, N, hidden). The searches never
    look inside a state; they only pass it to these methods."""

    def initial_state(self, batch_size: int, device: Any) -> Any:
        """State of ``batch_size`` rows before anything was emitted. The searches then call
        ``predict(blank ids, state)`` once to get the first decoder output (NeMo feeds blank as
        its start symbol; icefall's initial context is ``[-1] * (c - 1) + [blank]``, so its
        initial state is ``[-1] * c`` and ``predict`` shifts the blank in)."""
        ...

    def predict(self, tokens: Any, state: Any) -> tuple[Any, Any]:
        """Advance the prediction network by one token per row: ``tokens`` (N,) long ->
        ``(decoder_out (N, D_dec), new_state)``. ``decoder_out`` is what ``join`` takes as its
        second argument (a family may return it already projected)."""
        ...

    def select_state(self, state: Any, index: Any) -> Any:
        """Rows ``index`` (M,) long of a state, in that order; rows may repeat (beams)."""
        ...

    def merge_state(self, state: Any, new_state: Any, update: Any) -> Any:
        """Row-wise choice between two states of N rows: ``new_state`` where ``update`` (N,)
        bool is True, else ``state``."""
        ...

    def join(self, encoder_frames: Any, decoder_out: Any) -> Any:
        """Joiner logits (N, V) for N pairs of encoder frames (N, D_enc) and decoder outputs
        (N, D_dec), unnormalised. TDT: (N, V + len(durations)), the token logits first."""
        ...


# -- shared helpers -------------------------------------------------------------------------------


def _batch(encoder_out: Any, lengths: Any, batch_size: int | None = None) -> tuple[Any, list[int]]:
    """(B, T, D) frames (a (T, D) input is a batch of one) and per-row lengths as ints."""
    import torch

    enc = torch.as_tensor(encoder_out)
    if enc.dim() == 2:
        enc = enc.unsqueeze(0)
    if enc.dim() != 3:
        raise InvalidRequestError(
            f"encoder frames must be (batch, frames, dim) or (frames, dim), got shape "
            f"{tuple(enc.shape)}", param="encoder_out")
    if batch_size is not None and enc.shape[0] != batch_size:
        raise InvalidRequestError(
            f"this search was started for {batch_size} streams but got a chunk of "
            f"{enc.shape[0]}; feed one row per stream (length 0 for a stream without frames)",
            param="encoder_out")
    if lengths is None:
        lens = [int(enc.shape[1])] * int(enc.shape[0])
    else:
        lens = [int(n) for n in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
        if len(lens) != enc.shape[0] or any(n < 0 or n > enc.shape[1] for n in lens):
            raise InvalidRequestError(
                f"lengths {lens} do not fit encoder frames of shape {tuple(enc.shape)}: give one "
                f"length per row, each between 0 and {enc.shape[1]}", param="lengths")
    return enc, lens


def _check_positive(value: int, name: str) -> None:
    if int(value) < 1:
        raise InvalidRequestError(f"{name} must be at least 1, got {value}", param=name)


def _advance_rows(network: TransducerNetwork, state: Any, decoder_out: Any, rows: list[int],
                  tokens: list[int]) -> tuple[Any, Any]:
    """Feed ``tokens`` to the prediction network for ``rows`` only (the other rows keep their
    state and decoder output): the network runs on the M emitting rows, not on all N."""
    import torch

    device = decoder_out.device
    n = decoder_out.shape[0]
    row_index = torch.as_tensor(rows, dtype=torch.long, device=device)
    out, sub_state = network.predict(torch.as_tensor(tokens, dtype=torch.long, device=device),
                                     network.select_state(state, row_index))
    # spread the M new rows over N (rows that did not emit read row 0, and are then not taken)
    spread = torch.zeros(n, dtype=torch.long, device=device)
    spread[row_index] = torch.arange(len(rows), dtype=torch.long, device=device)
    update = torch.zeros(n, dtype=torch.bool, device=device)
    update[row_index] = True
    state = network.merge_state(state, network.select_state(sub_state, spread), update)
    decoder_out = decoder_out.clone()
    decoder_out[row_index] = out.to(decoder_out.dtype)
    return state, decoder_out


def _start(network: TransducerNetwork, batch_size: int, blank_id: int, device: Any) -> tuple[Any, Any]:
    import torch

    state = network.initial_state(batch_size, device)
    blanks = torch.full((batch_size,), blank_id, dtype=torch.long, device=device)
    decoder_out, state = network.predict(blanks, state)
    return state, decoder_out


def _copy(h: Hypothesis) -> Hypothesis:
    return Hypothesis(list(h.tokens), h.score, list(h.times), list(h.token_logprobs),
                      list(h.durations))


# -- greedy (RNN-T) ---------------------------------------------------------------------------------


#: the shortest chunk worth capturing a CUDA graph for (a capture costs a few frames' time)
GRAPH_MIN_FRAMES = 32


def _capture(fn: Any) -> Any:
    """A CUDA graph of ``fn()`` (warmed up by the caller). ``torch.cuda.graph`` without its
    device synchronisation and cache flush on entry: captured per call, the flush would make the
    encoder allocate its memory afresh on every next call."""
    import torch

    from oasr.stream_cache import CAPTURE_LOCK

    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    # one capture at a time, and other threads' device work (a server's stream loop) must not
    # invalidate it: see GraphSteps
    with CAPTURE_LOCK, torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="thread_local")
        try:
            fn()
        except BaseException:
            try:
                graph.capture_end()
            except RuntimeError:
                pass  # the capture was invalidated; the first error is the one to report
            raise
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph


def _tree_clone(state: Any) -> Any:
    if isinstance(state, (tuple, list)):
        return type(state)(_tree_clone(x) for x in state)
    return state.clone()


def _tree_copy_(dst: Any, src: Any) -> None:
    if isinstance(dst, (tuple, list)):
        for d, x in zip(dst, src, strict=True):
            _tree_copy_(d, x)
    else:
        dst.copy_(src)


class _DeviceGreedy:
    """One on-device greedy pass (one symbol per frame) over a chunk. Every per-frame tensor
    lives in a fixed buffer and the frame index is a device scalar, so a frame is a fixed
    sequence of kernels that can be captured once as a CUDA graph and replayed per frame."""

    def __init__(self, search: TransducerGreedySearch, enc: Any, lens: list[int]) -> None:
        import torch

        dev = enc.device
        b, t_max = enc.shape[0], max(lens)
        self.search, self.network = search, search.network
        self.enc = enc[:, :t_max].contiguous()
        self.lens = torch.as_tensor(lens, device=dev)
        self.blanks = torch.full((b,), search.blank_id, dtype=torch.long, device=dev)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.tokens = torch.full((b, t_max), -1, dtype=torch.long, device=dev)
        self.logps = torch.zeros(b, t_max, dtype=torch.float32, device=dev)
        self.state = _tree_clone(search._state)
        self.decoder_out = search._decoder_out.clone()

    def frame(self) -> None:
        import torch

        s = self.search
        enc_t = self.enc.index_select(1, self.t).squeeze(1)
        logits = self.network.join(enc_t, self.decoder_out).float()
        if s.blank_penalty:
            logits[:, s.blank_id] -= s.blank_penalty
        best = logits.argmax(dim=-1)
        self.logps.index_copy_(1, self.t, logits.log_softmax(dim=-1).gather(1, best.unsqueeze(1)))
        emit = self.t < self.lens
        for skip in sorted(s.skip_ids):
            emit = emit & (best != skip)
        self.tokens.index_copy_(1, self.t, torch.where(emit, best, -1).unsqueeze(1))
        out, new_state = self.network.predict(torch.where(emit, best, self.blanks), self.state)
        _tree_copy_(self.state, self.network.merge_state(self.state, new_state, emit))
        self.decoder_out.copy_(torch.where(emit.unsqueeze(1), out.to(self.decoder_out.dtype),
                                           self.decoder_out))
        self.t += 1

    def eager(self, t_max: int) -> None:
        for _ in range(t_max):
            self.frame()

    def replay_graph(self, t_max: int) -> None:
        import torch

        state0, out0 = _tree_clone(self.state), self.decoder_out.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: libraries set up outside the capture
            self.frame()
        torch.cuda.current_stream().wait_stream(side)
        graph = _capture(self.frame)
        # the warm-up advanced the buffers (the capture did not run): start again
        _tree_copy_(self.state, state0)
        self.decoder_out.copy_(out0)
        self.t.zero_()
        self.tokens.fill_(-1)
        self.logps.zero_()
        for _ in range(t_max):
            graph.replay()


class TransducerGreedySearch:
    """Greedy transducer search over ``batch_size`` streams, fed any number of frames at a time.

    ``step(encoder_frames (B, T, D), lengths)`` consumes the next frames of every stream
    (``lengths[b]`` of them for stream b; chunks of any size give the offline result, since a
    frame is always finished within its chunk); ``results()`` returns the hypotheses so far, with
    ``times`` counted from each stream's first frame. ``score`` is the log-probability of the
    greedy path (every joiner step, blanks included); ``token_logprobs`` are log-softmax values of
    the emitted tokens. ``unk_id`` (icefall) is treated like blank; ``blank_penalty`` is
    subtracted from the blank logit before the decision (icefall's ``--blank-penalty``)."""

    #: ``sync_free`` with several symbols per frame: chunks of at least this many frames run
    #: the device loop; shorter ones (a streaming step's) the frame loop, which launches fewer
    #: kernels for a few frames
    label_looping_min_frames = GRAPH_MIN_FRAMES

    def __init__(self, network: TransducerNetwork, batch_size: int = 1, *, blank_id: int = 0,
                 max_symbols_per_frame: int = 1, unk_id: int | None = None,
                 blank_penalty: float = 0.0, sync_free: bool | None = None,
                 cuda_graph: bool = False) -> None:
        _check_positive(batch_size, "batch_size")
        _check_positive(max_symbols_per_frame, "max_symbols_per_frame")
        #: no host read per frame (every row's prediction network runs each step; rows that did
        #: not emit keep their state): None = on CUDA. One symbol per frame: a frame loop on the
        #: device; more (without ``unk_id``, chunks of ``label_looping_min_frames``): the TDT
        #: device loop with the one duration 0
        self.sync_free = sync_free
        #: with ``sync_free`` on CUDA, replay one frame (one symbol per frame; captured per call
        #: of at least ``GRAPH_MIN_FRAMES`` frames) or ``TDT_STEPS_PER_CHECK`` steps as a CUDA
        #: graph; a network whose ``join`` / ``predict`` cannot be captured falls back to eager
        #: steps. For prediction networks known to be capturable (icefall's stateless decoder,
        #: NeMo's LSTM)
        self.cuda_graph = cuda_graph
        self.network = network
        self.batch_size = batch_size
        self.blank_id = blank_id
        self.max_symbols_per_frame = int(max_symbols_per_frame)
        self.skip_ids = {blank_id} if unk_id is None else {blank_id, unk_id}
        self.blank_penalty = float(blank_penalty)
        self.frames = [0] * batch_size
        self._hyps = [Hypothesis(tokens=[]) for _ in range(batch_size)]
        self._state: Any = None
        self._decoder_out: Any = None

    @classmethod
    def resume(cls, network: TransducerNetwork, hyps: Sequence[Hypothesis], frames: Sequence[int],
               state: Any, decoder_out: Any, **settings: Any) -> TransducerGreedySearch:
        """A search over ``len(hyps)`` streams that continues where earlier searches stopped:
        their hypotheses, frames consumed, prediction-network ``state`` and ``decoder_out``
        (rows in the same order; ``settings`` are the constructor's keywords). A family that
        keeps each stream's search state itself builds one per step for the streams of that
        step, then reads each row back from ``results()``, ``frames``, ``state`` and
        ``decoder_out``."""
        search = cls(network, len(hyps), **settings)
        search._hyps = [_copy(h) for h in hyps]
        search.frames = [int(f) for f in frames]
        search._state, search._decoder_out = state, decoder_out
        return search

    @property
    def state(self) -> Any:
        """The prediction network's state of every row (None before the first frame)."""
        return self._state

    @property
    def decoder_out(self) -> Any:
        """The decoder output the next frame of each row is joined with (None before)."""
        return self._decoder_out

    def step(self, encoder_frames: Any, lengths: Sequence[int] | Any | None = None) -> None:
        import torch

        enc, lens = _batch(encoder_frames, lengths, self.batch_size)
        if max(lens, default=0) == 0:
            return
        with torch.no_grad():
            if self._state is None:
                self._state, self._decoder_out = _start(self.network, self.batch_size,
                                                        self.blank_id, enc.device)
            sync_free = self.sync_free if self.sync_free is not None else enc.device.type == "cuda"
            if sync_free and self.max_symbols_per_frame == 1:
                self._step_on_device(enc, lens)
            elif (sync_free and self.skip_ids == {self.blank_id}
                  and max(lens) >= self.label_looping_min_frames):
                self._step_label_looping(enc, lens)
            else:
                for t in range(max(lens)):
                    pending = [b for b in range(self.batch_size) if t < lens[b]]
                    for _ in range(self.max_symbols_per_frame):
                        pending = self._emit(enc, t, pending)
                        if not pending:
                            break
        for b in range(self.batch_size):
            self.frames[b] += lens[b]

    def _step_on_device(self, enc: Any, lens: list[int]) -> None:
        """``max_symbols_per_frame == 1`` with the whole chunk on the device: per frame, every
        row is joined, the emitting rows' prediction network advances (``merge_state``), and the
        tokens and log-probabilities are read back once at the end. Same hypotheses as the
        frame-by-frame loop."""
        t_max = max(lens)
        run = _DeviceGreedy(self, enc, lens)
        if self.cuda_graph and enc.device.type == "cuda" and t_max >= GRAPH_MIN_FRAMES:
            try:
                run.replay_graph(t_max)
            except RuntimeError as exc:  # not capturable: eager frames, same results
                import logging

                logging.getLogger(__name__).warning("transducer greedy: CUDA graph capture "
                                                    "failed (%s); running eagerly", exc)
                run = _DeviceGreedy(self, enc, lens)
                run.eager(t_max)
        else:
            run.eager(t_max)
        self._state, self._decoder_out = run.state, run.decoder_out
        # per row with numpy, not per frame in Python (64 rows x 750 frames is 48k iterations)
        tokens_a, logps_a = run.tokens.cpu().numpy(), run.logps.cpu().numpy().astype("float64")
        for r in range(self.batch_size):
            hyp, n = self._hyps[r], lens[r]
            lps = logps_a[r, :n]
            hyp.score += float(lps.sum())
            at = (tokens_a[r, :n] >= 0).nonzero()[0]
            hyp.tokens += tokens_a[r, at].tolist()
            hyp.times += (at + self.frames[r]).tolist()
            hyp.token_logprobs += lps[at].tolist()

    def _step_label_looping(self, enc: Any, lens: list[int]) -> None:
        """``max_symbols_per_frame > 1`` on the device: the TDT loop (:class:`_DeviceTDT`) with
        the one duration 0. A token keeps its row on the frame, a blank moves it one frame on,
        ``max_symbols_per_frame`` tokens on one frame move it on too: the frame loop's
        hypotheses, with every row stepped at once (CUDA graphs with ``cuda_graph``)."""
        tdt = TDTGreedySearch(_WithDurationLogit(self.network, self.blank_id, self.blank_penalty),
                              [0], self.batch_size, blank_id=self.blank_id,
                              max_symbols_per_frame=self.max_symbols_per_frame, sync_free=True,
                              cuda_graph=self.cuda_graph)
        tdt._state, tdt._decoder_out = self._state, self._decoder_out
        tdt.frames, tdt.time = list(self.frames), list(self.frames)
        tdt.step(enc, lens)
        self._state, self._decoder_out = tdt._state, tdt._decoder_out
        for hyp, new in zip(self._hyps, tdt._hyps, strict=True):
            hyp.score += new.score
            hyp.tokens += new.tokens
            hyp.times += new.times
            hyp.token_logprobs += new.token_logprobs

    def _emit(self, enc: Any, t: int, rows: list[int]) -> list[int]:
        """One joiner step at column ``t`` for ``rows``; returns the rows that emitted a token."""
        import torch

        index = torch.as_tensor(rows, dtype=torch.long, device=enc.device)
        logits = self.network.join(enc[index, t], self._decoder_out[index]).float()
        if self.blank_penalty:
            logits[:, self.blank_id] -= self.blank_penalty
        best = logits.argmax(dim=-1)
        logp = logits.log_softmax(dim=-1).gather(1, best.unsqueeze(1)).squeeze(1)
        emitted_rows, emitted_tokens = [], []
        for b, token, lp in zip(rows, best.tolist(), logp.tolist(), strict=True):
            hyp = self._hyps[b]
            hyp.score += lp
            if token not in self.skip_ids:
                hyp.tokens.append(token)
                hyp.times.append(self.frames[b] + t)
                hyp.token_logprobs.append(lp)
                emitted_rows.append(b)
                emitted_tokens.append(token)
        if emitted_rows:
            self._state, self._decoder_out = _advance_rows(
                self.network, self._state, self._decoder_out, emitted_rows, emitted_tokens)
        return emitted_rows

    def results(self) -> list[Hypothesis]:
        return [_copy(h) for h in self._hyps]


def transducer_greedy_search(network: TransducerNetwork, encoder_out: Any,
                             lengths: Sequence[int] | Any | None = None, *, blank_id: int = 0,
                             max_symbols_per_frame: int = 1, unk_id: int | None = None,
                             blank_penalty: float = 0.0, sync_free: bool | None = None,
                             cuda_graph: bool = False) -> list[Hypothesis]:
    """Greedy search of each utterance of a (B, T, D) batch (or one (T, D) input -> a list of
    one). See :class:`TransducerGreedySearch`."""
    enc, lens = _batch(encoder_out, lengths)
    search = TransducerGreedySearch(network, enc.shape[0], blank_id=blank_id,
                                    max_symbols_per_frame=max_symbols_per_frame, unk_id=unk_id,
                                    blank_penalty=blank_penalty, sync_free=sync_free,
                                    cuda_graph=cuda_graph)
    search.step(enc, lens)
    return search.results()


# -- modified beam search ---------------------------------------------------------------------------


class _Beam:
    """One hypothesis of the beam; ``row`` is its row in the stacked decoder state."""

    __slots__ = ("tokens", "score", "times", "logprobs", "row", "cstate")

    def __init__(self, tokens: tuple[int, ...], score: float, times: list[int],
                 logprobs: list[float], row: int, cstate: int = 0) -> None:
        self.tokens = tokens
        self.score = score
        self.times = times
        self.logprobs = logprobs
        self.row = row
        self.cstate = cstate  # hotword context-graph state (0: the root / no graph)


def _log_add(a: float, b: float) -> float:
    if a == -math.inf:
        return b
    if b == -math.inf:
        return a
    hi, lo = (a, b) if a > b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


class TransducerModifiedBeamSearch:
    """icefall's modified beam search over ``batch_size`` streams, fed any number of frames at
    a time (``step``), with ``nbest()`` available after any chunk.

    Per frame and utterance: every hypothesis in the beam is scored against every token,
    ``log_softmax((logits - blank_penalty on blank) / temperature) + hypothesis score``; the
    ``beam_size`` best (hypothesis, token) pairs survive; blank (and ``unk_id``) keep the token
    sequence, other tokens extend it (at most one symbol per frame); pairs with equal token
    sequences are merged by log-add (the first one's times are kept). ``score`` is that
    log-probability; ``nbest()`` ranks by ``score / (len(tokens) + length_norm_offset)`` when
    ``length_norm`` (icefall's ``get_most_probable(length_norm=True)`` divides by the length of
    its token list, which starts with ``context_size`` padding symbols: pass that as the offset
    to rank exactly as icefall), else by ``score``.

    Hotwords: with a ``context_graph`` (:class:`oasr.decoders.context_graph.ContextGraph`, one
    for every stream or one per stream) a non-blank token's graph bonus is added to the
    surviving pair's score after the top-k, as icefall's biased modified beam search does."""

    def __init__(self, network: TransducerNetwork, beam_size: int = 4, batch_size: int = 1, *,
                 blank_id: int = 0, unk_id: int | None = None, temperature: float = 1.0,
                 blank_penalty: float = 0.0, length_norm: bool = True,
                 length_norm_offset: int = 1, context_graph: Any = None) -> None:
        _check_positive(beam_size, "beam_size")
        _check_positive(batch_size, "batch_size")
        if not temperature > 0:
            raise InvalidRequestError(f"temperature must be > 0, got {temperature}",
                                      param="temperature")
        self.network = network
        self.beam_size = int(beam_size)
        self.batch_size = batch_size
        self.blank_id = blank_id
        self.skip_ids = {blank_id} if unk_id is None else {blank_id, unk_id}
        self.temperature = float(temperature)
        self.blank_penalty = float(blank_penalty)
        self.length_norm = length_norm
        self.length_norm_offset = length_norm_offset
        self.frames = [0] * batch_size
        self._beams = [[_Beam((), 0.0, [], [], b)] for b in range(batch_size)]
        # hotwords: one ContextGraph for every stream, or one (or None) per stream
        graphs = context_graph if isinstance(context_graph, (list, tuple)) else [context_graph] * batch_size
        if len(graphs) != batch_size:
            raise ValueError("context_graph: one graph per stream")
        self.context_graphs = list(graphs)
        self._state: Any = None
        self._decoder_out: Any = None

    def step(self, encoder_frames: Any, lengths: Sequence[int] | Any | None = None) -> None:
        import torch

        enc, lens = _batch(encoder_frames, lengths, self.batch_size)
        if max(lens, default=0) == 0:
            return
        with torch.no_grad():
            if self._state is None:
                self._state, self._decoder_out = _start(self.network, self.batch_size,
                                                        self.blank_id, enc.device)
            for t in range(max(lens)):
                self._frame(enc, t, [b for b in range(self.batch_size) if t < lens[b]])
        for b in range(self.batch_size):
            self.frames[b] += lens[b]

    def _frame(self, enc: Any, t: int, active: list[int]) -> None:
        import torch

        device = enc.device
        rows = [h.row for b in active for h in self._beams[b]]
        utt = [b for b in active for _ in self._beams[b]]
        row_index = torch.as_tensor(rows, dtype=torch.long, device=device)
        logits = self.network.join(enc[torch.as_tensor(utt, dtype=torch.long, device=device), t],
                                   self._decoder_out[row_index]).float()
        if self.blank_penalty:
            logits[:, self.blank_id] -= self.blank_penalty
        logp = (logits / self.temperature).log_softmax(dim=-1)
        vocab = logp.shape[1]
        hyp_scores = torch.tensor([h.score for b in active for h in self._beams[b]],
                                  dtype=torch.float32, device=device)
        total = logp + hyp_scores.unsqueeze(1)
        # one padded top-k for all utterances: (utterances, most hypotheses * vocab)
        counts = [len(self._beams[b]) for b in active]
        widest = max(counts)
        padded = torch.full((len(active), widest, vocab), -math.inf, device=device)
        utt_pos = torch.as_tensor([i for i, c in enumerate(counts) for _ in range(c)],
                                  dtype=torch.long, device=device)
        hyp_pos = torch.as_tensor([j for c in counts for j in range(c)], dtype=torch.long,
                                  device=device)
        padded[utt_pos, hyp_pos] = total
        k = min(self.beam_size, widest * vocab)
        top_values, top_index = padded.view(len(active), -1).topk(k, dim=-1)
        top_hyp = torch.div(top_index, vocab, rounding_mode="floor")
        top_token = top_index % vocab
        first_row = torch.as_tensor([sum(counts[:i]) for i in range(len(counts))],
                                    dtype=torch.long, device=device)
        flat_rows = (first_row.unsqueeze(1) + top_hyp.clamp(max=widest - 1)).clamp(
            max=len(rows) - 1)
        token_logp = logp[flat_rows, top_token]

        parents: list[int] = []  # state row of each new hypothesis' parent
        emitted: list[tuple[int, int]] = []  # (new hypothesis position, token)
        new_beams: dict[int, list[_Beam]] = {}
        for i, b in enumerate(active):
            old = self._beams[b]
            merged: dict[tuple[int, ...], _Beam] = {}
            for value, h, token, lp in zip(top_values[i].tolist(), top_hyp[i].tolist(),
                                           top_token[i].tolist(), token_logp[i].tolist(),
                                           strict=True):
                if h >= counts[i]:
                    continue  # padding: the utterance has fewer candidates than the beam
                parent = old[h]
                cstate = parent.cstate
                if token in self.skip_ids:
                    key, times, lps = parent.tokens, parent.times, parent.logprobs
                else:
                    key = parent.tokens + (token,)
                    times = parent.times + [self.frames[b] + t]
                    lps = parent.logprobs + [lp]
                    graph = self.context_graphs[b]
                    if graph is not None:  # icefall: the bonus joins the score after the top-k
                        bonus, cstate = graph.step(cstate, token)
                        value += bonus
                same = merged.get(key)
                if same is not None:
                    same.score = _log_add(same.score, value)
                    continue
                beam = _Beam(key, value, list(times), list(lps), len(parents), cstate)
                merged[key] = beam
                if token not in self.skip_ids:
                    emitted.append((len(parents), token))
                parents.append(parent.row)
            new_beams[b] = list(merged.values())
        for b in range(self.batch_size):  # finished utterances keep their beam as it is
            if b not in new_beams:
                for beam in self._beams[b]:
                    parent_row, beam.row = beam.row, len(parents)
                    parents.append(parent_row)
                new_beams[b] = self._beams[b]
        self._beams = [new_beams[b] for b in range(self.batch_size)]
        parent_index = torch.as_tensor(parents, dtype=torch.long, device=device)
        state = self.network.select_state(self._state, parent_index)
        decoder_out = self._decoder_out[parent_index]
        if emitted:
            state, decoder_out = _advance_rows(self.network, state, decoder_out,
                                               [p for p, _ in emitted], [u for _, u in emitted])
        self._state, self._decoder_out = state, decoder_out

    def _rank(self, score: float, beam: _Beam) -> float:
        if self.length_norm:
            return score / (len(beam.tokens) + self.length_norm_offset)
        return score

    def nbest(self) -> list[list[Hypothesis]]:
        """Per stream, the hypotheses of the beam, best first (with hotwords: the bonus of an
        unfinished match taken back first, icefall's ``finalize``)."""
        out = []
        for beams, graph in zip(self._beams, self.context_graphs, strict=True):
            scored = [(h.score if graph is None else h.score + graph.finalize(h.cstate), h)
                      for h in beams]
            ranked = sorted(scored, key=lambda x: self._rank(*x), reverse=True)
            out.append([Hypothesis(list(h.tokens), score, list(h.times), list(h.logprobs))
                        for score, h in ranked])
        return out

    def best(self) -> list[Hypothesis]:
        return [n[0] for n in self.nbest()]


def transducer_modified_beam_search(network: TransducerNetwork, encoder_out: Any,
                                    lengths: Sequence[int] | Any | None = None, *,
                                    beam_size: int = 4, blank_id: int = 0,
                                    unk_id: int | None = None, temperature: float = 1.0,
                                    blank_penalty: float = 0.0, length_norm: bool = True,
                                    length_norm_offset: int = 1,
                                    context_graph: Any = None) -> list[list[Hypothesis]]:
    """n-best lists (best first) for each utterance of a (B, T, D) batch (or one (T, D) input).
    See :class:`TransducerModifiedBeamSearch`."""
    enc, lens = _batch(encoder_out, lengths)
    search = TransducerModifiedBeamSearch(
        network, beam_size, enc.shape[0], blank_id=blank_id, unk_id=unk_id,
        temperature=temperature, blank_penalty=blank_penalty, length_norm=length_norm,
        length_norm_offset=length_norm_offset, context_graph=context_graph)
    search.step(enc, lens)
    return search.nbest()


# -- TDT greedy ---------------------------------------------------------------------------------------


class _WithDurationLogit:
    """A transducer network whose joiner gives one more logit, for the single duration 0
    (log-probability 0): RNN-T greedy as a TDT search. ``blank_penalty`` is applied here."""

    def __init__(self, network: TransducerNetwork, blank_id: int, blank_penalty: float) -> None:
        self.network, self.blank_id, self.blank_penalty = network, blank_id, blank_penalty

    def initial_state(self, batch_size: int, device: Any) -> Any:
        return self.network.initial_state(batch_size, device)

    def predict(self, tokens: Any, state: Any) -> tuple[Any, Any]:
        return self.network.predict(tokens, state)

    def select_state(self, state: Any, index: Any) -> Any:
        return self.network.select_state(state, index)

    def merge_state(self, state: Any, new_state: Any, update: Any) -> Any:
        return self.network.merge_state(state, new_state, update)

    def join(self, encoder_frames: Any, decoder_out: Any) -> Any:
        import torch

        logits = self.network.join(encoder_frames, decoder_out).float()
        if self.blank_penalty:
            logits[:, self.blank_id] -= self.blank_penalty
        return torch.cat([logits, logits.new_zeros(logits.shape[0], 1)], 1)


#: TDT steps between two reads of the "still running?" flag (one CUDA graph replay)
TDT_STEPS_PER_CHECK = 16


#: encoder widths a cached TDT runner is allocated for: multiples of this many frames
TDT_WIDTH_BUCKET = 64
#: TDT runners (buffers + CUDA graph) kept for the next call of the same shape, least recently
#: used dropped first
TDT_CACHED_RUNNERS = 4
_tdt_runners: dict[tuple, tuple[Any, Any, Any]] = {}  # key -> (network ref, lock, runner)
_tdt_runners_lock = threading.Lock()


def _runner_key(search: TDTGreedySearch, enc: Any) -> tuple[Any, tuple]:
    """(the network whose weights a graph reads, the cache key of a runner for ``search``)."""
    net = search.network
    extra: tuple = ()
    if isinstance(net, _WithDurationLogit):  # one per call: key on the network it wraps
        net, extra = net.network, (net.blank_penalty,)
    key = (id(net), extra, search.batch_size, -(-int(enc.shape[1]) // TDT_WIDTH_BUCKET),
           int(enc.shape[2]), str(enc.dtype), str(enc.device), search.blank_id,
           search.max_symbols_per_frame, tuple(search.durations), TDT_STEPS_PER_CHECK)
    return net, key


class _DeviceTDT:
    """The TDT greedy loop over every row at once, on the device (NeMo's label looping).

    Each step joins every row at its time pointer (finished rows are masked), writes the emitted
    tokens into fixed buffers, advances the pointers by the predicted durations and the
    prediction network of the emitting rows (``merge_state``). Every tensor a step reads or
    writes is a fixed buffer updated in place, so ``TDT_STEPS_PER_CHECK`` steps are a fixed
    sequence of kernels: captured once as a CUDA graph and replayed. The host reads a two-number
    status (still running, most emissions of a row) after each group of steps, one group behind
    the device so that it never waits for the group in flight, and every result in one transfer
    at the end."""

    #: read each group's status one group late also off CUDA (where nothing runs ahead): the
    #: CUDA control flow, exercised by the CPU tests
    lagged_status = False
    #: keep runners (their buffers and CUDA graph) for the next call of the same shape: one
    #: capture per (network, batch, width bucket). None: with CUDA graphs only
    cache_runners: bool | None = None

    @classmethod
    def acquire(cls, search: TDTGreedySearch, enc: Any, first: list[int], graph: bool
                ) -> tuple[_DeviceTDT, Any]:
        """A loaded runner for this call and the lock to release after it (None: not cached).
        A cached runner is reused when its network is alive and it fits; a runner another call
        holds is not waited for (a fresh one serves this call)."""
        import weakref

        cache = cls.cache_runners if cls.cache_runners is not None else graph
        if not cache:
            run = cls(search, enc)
            run.load(search, enc, first)
            return run, None
        net, key = _runner_key(search, enc)
        with _tdt_runners_lock:
            entry = _tdt_runners.pop(key, None)
            if entry is not None and (entry[0]() is not net or not entry[2].fits(search, enc)):
                entry = None
            if entry is None:
                width = -(-int(enc.shape[1]) // TDT_WIDTH_BUCKET) * TDT_WIDTH_BUCKET
                entry = (weakref.ref(net), threading.Lock(), cls(search, enc, width))
            _tdt_runners[key] = entry  # most recently used last
            while len(_tdt_runners) > TDT_CACHED_RUNNERS:
                _tdt_runners.pop(next(iter(_tdt_runners)))
            lock, run = entry[1], entry[2]
            if not lock.acquire(blocking=False):
                run, lock = cls(search, enc), None
        run.network = search.network
        run.load(search, enc, first)
        return run, lock

    def __init__(self, search: TDTGreedySearch, enc: Any, width: int | None = None) -> None:
        """Buffers for ``search``'s rows and encoder frames of up to ``width`` columns (default
        ``enc``'s); :meth:`load` fills them for one call."""
        import torch

        dev = enc.device
        n = search.batch_size
        self.network = search.network
        self.blank_id, self.max_symbols = search.blank_id, search.max_symbols_per_frame
        self.n_durations = len(search.durations)
        self.width = int(width or enc.shape[1])
        self.enc = enc.new_zeros(n, self.width, enc.shape[2])
        self.rows = torch.arange(n, device=dev)
        self.durations = torch.as_tensor(search.durations, dtype=torch.long, device=dev)
        self.start, self.end, self.time, self.last, self.run_length, self.count = (
            torch.zeros(n, dtype=torch.long, device=dev) for _ in range(6))
        self.score = torch.zeros(n, dtype=torch.float32, device=dev)
        self.blank = torch.full((n,), search.blank_id, dtype=torch.long, device=dev)
        self.status = torch.zeros(2, dtype=torch.long, device=dev)  # running, most emissions
        # emissions per row (token, frame, duration; log-probability); column ``cap`` takes the
        # writes of rows that did not emit. Grown (and the graph captured again) when needed
        self.cap = self.width + 2 * TDT_STEPS_PER_CHECK
        self.emitted = torch.zeros(3, n, self.cap + 1, dtype=torch.long, device=dev)
        self.logps = torch.zeros(n, self.cap + 1, dtype=torch.float32, device=dev)
        self.state = _tree_clone(search._state)
        self.decoder_out = search._decoder_out.clone()
        self.graph: Any = None
        self.most = 0

    def fits(self, search: TDTGreedySearch, enc: Any) -> bool:
        """Whether these buffers (and their graph) serve ``search`` on ``enc``."""
        def shapes(t: Any) -> Any:
            if isinstance(t, (tuple, list)):
                return tuple(shapes(x) for x in t)
            return (tuple(t.shape), t.dtype, t.device)

        return (enc.shape[1] <= self.width and enc.shape[2] == self.enc.shape[2]
                and enc.dtype == self.enc.dtype and enc.device == self.enc.device
                and shapes(search._state) == shapes(self.state)
                and shapes(search._decoder_out) == shapes(self.decoder_out))

    def load(self, search: TDTGreedySearch, enc: Any, first: list[int]) -> None:
        """This call's encoder frames and the rows' pointers and prediction-network state."""
        import torch

        w = enc.shape[1]
        self.enc[:, :w].copy_(enc)
        for buf, values in ((self.start, first), (self.end, search.frames), (self.time, search.time),
                            (self.last, search._last_time), (self.run_length, search._run)):
            buf.copy_(torch.as_tensor(values, dtype=torch.long))
        self.count.zero_()
        self.score.zero_()
        _tree_copy_(self.state, search._state)
        self.decoder_out.copy_(search._decoder_out)
        self.most = 0

    def step(self) -> None:
        import torch

        active = self.time < self.end
        column = (self.time - self.start).clamp(0, self.width - 1)
        logits = self.network.join(self.enc[self.rows, column], self.decoder_out).float()
        n_tok = logits.shape[-1] - self.n_durations
        if n_tok <= self.blank_id:
            raise CheckpointError(
                f"the joiner gives {logits.shape[-1]} logits, too few for blank id {self.blank_id} "
                f"and {self.n_durations} durations; check the TDT durations and the vocabulary "
                f"size of the model")
        tok_logits, dur_logits = logits[:, :n_tok], logits[:, n_tok:]
        token = tok_logits.argmax(-1)
        d_index = dur_logits.argmax(-1)
        lp = tok_logits.log_softmax(-1).gather(1, token[:, None])[:, 0]
        dlp = dur_logits.log_softmax(-1).gather(1, d_index[:, None])[:, 0]
        skip = self.durations[d_index]
        # (kernel count matters here: a step is a few dozen small kernels, replayed ~1000 times)
        self.score.add_((lp + dlp) * active)
        emit = active & (token != self.blank_id)
        slot = torch.where(emit, self.count, torch.full_like(self.count, self.cap))[:, None]
        values = torch.stack([token, self.time, skip])[:, :, None]
        self.emitted.scatter_(2, slot.unsqueeze(0).expand(3, -1, -1), values)
        self.logps.scatter_(1, slot, lp[:, None])
        self.count.add_(emit)
        # tokens emitted at this frame so far: one more on the same frame, else the first
        same_frame = self.last == self.time
        self.run_length.copy_(torch.where(emit, self.run_length * same_frame + 1, self.run_length))
        self.last.copy_(torch.where(emit, self.time, self.last))
        advance = torch.where(emit, skip, skip.clamp_min(1))
        stuck = emit & (skip == 0) & (self.run_length >= self.max_symbols)
        self.time.add_((advance + stuck) * active)
        out, new_state = self.network.predict(torch.where(emit, token, self.blank), self.state)
        _tree_copy_(self.state, self.network.merge_state(self.state, new_state, emit))
        self.decoder_out.copy_(torch.where(emit[:, None], out.to(self.decoder_out.dtype),
                                           self.decoder_out))

    def steps(self) -> None:
        """``TDT_STEPS_PER_CHECK`` steps, then the status (what a graph replay does)."""
        import torch

        for _ in range(TDT_STEPS_PER_CHECK):
            self.step()
        self.status.copy_(torch.stack([(self.time < self.end).any().long(), self.count.max()]))

    def _launch(self, graph: bool) -> None:
        import torch

        if not graph:
            self.steps()
        elif self.graph is not None:
            self.graph.replay()
        else:
            # warm-up on a side stream (libraries set up outside the capture); its steps are real
            # progress: the capture below records the same kernels without running them
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.steps()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = _capture(self.steps)

    def _grow(self) -> None:
        import torch

        extra = max(self.cap, 2 * TDT_STEPS_PER_CHECK)
        cap = self.cap
        self.emitted = torch.cat([self.emitted[:, :, :cap], self.emitted.new_zeros(
            3, self.emitted.shape[1], extra), self.emitted[:, :, cap:]], 2)
        self.logps = torch.cat([self.logps[:, :cap], self.logps.new_zeros(self.logps.shape[0], extra),
                                self.logps[:, cap:]], 1)
        self.cap += extra
        self.graph = None  # its buffers are gone: capture again

    def run(self, graph: bool) -> None:
        """Step until every row has reached its end."""
        import torch

        cuda = self.enc.device.type == "cuda"
        lagged = cuda or self.lagged_status
        host = torch.zeros(2, 2, dtype=torch.long, pin_memory=cuda)
        done = [torch.cuda.Event() for _ in range(2)] if cuda else []
        group = 0
        while True:
            try:
                self._launch(graph)
            except RuntimeError as exc:
                if not graph:
                    raise
                import logging

                logging.getLogger(__name__).warning(
                    "TDT greedy: CUDA graph capture failed (%s); running eagerly", exc)
                graph = False  # the warm-up's steps stand; go on from there
                self.graph = None
                continue
            slot = group % 2
            host[slot].copy_(self.status, non_blocking=cuda)
            if cuda:
                done[slot].record()
            group += 1
            if lagged:  # read the group before the one just launched (still in flight on CUDA)
                if group == 1:
                    continue
                slot = group % 2
                if cuda:
                    done[slot].synchronize()
            running, self.most = host[slot].tolist()
            if not running:
                break
            # the groups in flight and the next may each add one emission per row and step
            if self.most + 2 * TDT_STEPS_PER_CHECK > self.cap:
                self._grow()

    def read_back(self) -> tuple[list[Any], ...]:
        """(time, last, run, counts, scores, tokens, times, durations, logprobs) per row, in
        one device-to-host transfer."""
        import torch

        n, k = self.count.shape[0], self.most
        ints = torch.cat([torch.stack([self.time, self.last, self.run_length, self.count]).reshape(-1),
                          self.emitted[:, :, :k].reshape(-1)])
        floats = torch.cat([self.score, self.logps[:, :k].reshape(-1)])
        if self.enc.device.type == "cuda":
            ints_h = torch.empty(ints.shape, dtype=ints.dtype, pin_memory=True)
            floats_h = torch.empty(floats.shape, dtype=floats.dtype, pin_memory=True)
            ints_h.copy_(ints, non_blocking=True)
            floats_h.copy_(floats, non_blocking=True)
            torch.cuda.current_stream().synchronize()
            ints, floats = ints_h, floats_h
        rows = ints[: 4 * n].reshape(4, n).tolist()
        emitted = ints[4 * n :].reshape(3, n, k).tolist()
        return (*rows, floats[:n].tolist(), *emitted, floats[n:].reshape(n, k).tolist())


class TDTGreedySearch:
    """Greedy token-and-duration transducer search (NeMo's batched greedy TDT) over
    ``batch_size`` streams, fed any number of frames at a time.

    The joiner's last ``len(durations)`` logits score the durations (frames to advance),
    the others the tokens (``blank_id`` among them; NeMo's blank is the last token). At each
    stream's time pointer: token = argmax of the token logits, duration = ``durations[argmax]``
    of the duration logits; a token other than blank is emitted with that duration (its time is
    the pointer, then the prediction network advances); the pointer moves by the duration, at
    least one frame after a blank; after ``max_symbols_per_frame`` tokens emitted at one frame
    with duration 0 it moves one frame. A stream's pointer may jump past the end of a chunk; the
    rest of the jump is taken from the next chunk, so chunks of any size give the offline result.

    ``score`` sums, over every joiner step, the log-probabilities of the chosen token and of the
    chosen duration (each log-softmaxed over its own part of the logits); ``token_logprobs`` are
    the token parts of the emitted tokens; ``durations`` the predicted frames per token."""

    def __init__(self, network: TransducerNetwork, durations: Sequence[int], batch_size: int = 1,
                 *, blank_id: int, max_symbols_per_frame: int = 10,
                 sync_free: bool | None = None, cuda_graph: bool = False) -> None:
        _check_positive(batch_size, "batch_size")
        _check_positive(max_symbols_per_frame, "max_symbols_per_frame")
        #: every row stepped on the device, the host reading only a "still running?" flag every
        #: few steps and the results at the end (default on CUDA); same hypotheses as the loop
        self.sync_free = sync_free
        #: with ``sync_free`` on CUDA, replay ``TDT_STEPS_PER_CHECK`` steps as one CUDA graph
        #: (captured per call; a network that cannot be captured runs the steps eagerly)
        self.cuda_graph = cuda_graph
        self.durations = [int(d) for d in durations]
        if not self.durations or min(self.durations) < 0:
            raise CheckpointError(
                f"TDT durations must be a non-empty list of frame counts >= 0, got {durations!r}; "
                f"check the model's decoding config (NeMo: model_defaults.tdt_durations)")
        self.network = network
        self.batch_size = batch_size
        self.blank_id = blank_id
        self.max_symbols_per_frame = int(max_symbols_per_frame)
        self.frames = [0] * batch_size  # frames received per stream
        self.time = [0] * batch_size  # each stream's time pointer (absolute frame)
        self._last_time = [-1] * batch_size  # frame of the last emitted token ...
        self._run = [0] * batch_size  # ... and how many tokens were emitted there
        self._hyps = [Hypothesis(tokens=[]) for _ in range(batch_size)]
        self._state: Any = None
        self._decoder_out: Any = None

    def step(self, encoder_frames: Any, lengths: Sequence[int] | Any | None = None) -> None:
        import torch

        enc, lens = _batch(encoder_frames, lengths, self.batch_size)
        first = list(self.frames)  # absolute frame of column 0, per stream
        for b in range(self.batch_size):
            self.frames[b] += lens[b]
        if max(lens, default=0) == 0:
            return
        with torch.no_grad():
            if self._state is None:
                self._state, self._decoder_out = _start(self.network, self.batch_size,
                                                        self.blank_id, enc.device)
            sync_free = self.sync_free if self.sync_free is not None else enc.device.type == "cuda"
            if sync_free:
                self._step_on_device(enc, first)
                return
            while True:
                active = [b for b in range(self.batch_size) if self.time[b] < self.frames[b]]
                if not active:
                    break
                self._step_rows(enc, active, [self.time[b] - first[b] for b in active])

    def _step_rows(self, enc: Any, rows: list[int], columns: list[int]) -> None:
        import torch

        device = enc.device
        index = torch.as_tensor(rows, dtype=torch.long, device=device)
        frames = enc[index, torch.as_tensor(columns, dtype=torch.long, device=device)]
        logits = self.network.join(frames, self._decoder_out[index]).float()
        n_tokens = logits.shape[-1] - len(self.durations)
        if n_tokens <= self.blank_id:
            raise CheckpointError(
                f"the joiner gives {logits.shape[-1]} logits, too few for blank id "
                f"{self.blank_id} and {len(self.durations)} durations; check the TDT "
                f"durations and the vocabulary size of the model")
        token_logits, duration_logits = logits[:, :n_tokens], logits[:, n_tokens:]
        token = token_logits.argmax(dim=-1)
        duration_index = duration_logits.argmax(dim=-1)
        token_lp = token_logits.log_softmax(-1).gather(1, token.unsqueeze(1)).squeeze(1)
        duration_lp = duration_logits.log_softmax(-1).gather(
            1, duration_index.unsqueeze(1)).squeeze(1)
        emitted_rows, emitted_tokens = [], []
        for b, u, d_index, lp, d_lp in zip(rows, token.tolist(), duration_index.tolist(),
                                           token_lp.tolist(), duration_lp.tolist(), strict=True):
            hyp = self._hyps[b]
            hyp.score += lp + d_lp
            skip = self.durations[d_index]
            if u == self.blank_id:
                self.time[b] += max(skip, 1)
                continue
            now = self.time[b]
            hyp.tokens.append(u)
            hyp.times.append(now)
            hyp.token_logprobs.append(lp)
            hyp.durations.append(skip)
            emitted_rows.append(b)
            emitted_tokens.append(u)
            self._run[b] = self._run[b] + 1 if self._last_time[b] == now else 1
            self._last_time[b] = now
            self.time[b] += skip
            if skip == 0 and self._run[b] >= self.max_symbols_per_frame:
                self.time[b] += 1
        if emitted_rows:
            self._state, self._decoder_out = _advance_rows(
                self.network, self._state, self._decoder_out, emitted_rows, emitted_tokens)

    def _step_on_device(self, enc: Any, first: list[int]) -> None:
        """The loop of :meth:`_step_rows` over all rows at once on the device
        (:class:`_DeviceTDT`): the host reads one flag per ``TDT_STEPS_PER_CHECK`` steps and the
        results once at the end; with ``cuda_graph`` on CUDA those steps replay as one graph."""
        graph = self.cuda_graph and enc.device.type == "cuda"
        run, lock = _DeviceTDT.acquire(self, enc, first, graph)
        try:
            run.run(graph=graph)
            if lock is None:
                self._state, self._decoder_out = run.state, run.decoder_out
            else:  # the runner's buffers serve the next call
                self._state = _tree_clone(run.state)
                self._decoder_out = run.decoder_out.clone()
            time, last, runs, counts, scores, tokens, times, durs, lps = run.read_back()
        finally:
            if lock is not None:
                lock.release()
        self.time, self._last_time, self._run = time, last, runs
        for b, (hyp, k, sc) in enumerate(zip(self._hyps, counts, scores, strict=True)):
            hyp.score += sc
            hyp.tokens += tokens[b][:k]
            hyp.times += times[b][:k]
            hyp.durations += durs[b][:k]
            hyp.token_logprobs += lps[b][:k]

    def results(self) -> list[Hypothesis]:
        return [_copy(h) for h in self._hyps]


def tdt_greedy_search(network: TransducerNetwork, encoder_out: Any,
                      lengths: Sequence[int] | Any | None = None, *, durations: Sequence[int],
                      blank_id: int, max_symbols_per_frame: int = 10,
                      sync_free: bool | None = None, cuda_graph: bool = False) -> list[Hypothesis]:
    """Greedy TDT search of each utterance of a (B, T, D) batch (or one (T, D) input). See
    :class:`TDTGreedySearch`."""
    enc, lens = _batch(encoder_out, lengths)
    search = TDTGreedySearch(network, durations, enc.shape[0], blank_id=blank_id,
                             max_symbols_per_frame=max_symbols_per_frame, sync_free=sync_free,
                             cuda_graph=cuda_graph)
    search.step(enc, lens)
    return search.results()


def duration_token_timestamps(
    tokens: Sequence[int],
    times: Sequence[int],
    durations: Sequence[int],
    confidences: Sequence[float],
    *,
    frame_shift: float,
    num_frames: int | None = None,
    offset: float = 0.0,
) -> list[TokenTiming]:
    """Token spans from TDT emission frames and predicted durations: a token starts at its frame
    and ends ``duration`` frames later (NeMo's token offsets), clipped to ``num_frames`` (the
    last duration may reach past the audio). Use :func:`oasr.decoders.token_timestamps` for
    transducers without durations."""
    end_limit = math.inf if num_frames is None else num_frames
    out = []
    for token, t, d, conf in zip(tokens, times, durations, confidences, strict=True):
        start = min(t, end_limit)
        end = min(t + d, end_limit)
        out.append(TokenTiming(int(token), round(start * frame_shift + offset, 3),
                               round(end * frame_shift + offset, 3), float(conf)))
    return out

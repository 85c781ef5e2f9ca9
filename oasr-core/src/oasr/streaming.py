"""``StreamingScheduler``: many live streams, one batched ``model.stream_step`` per step.

The scheduler owns each stream's buffered audio and its model state
(:class:`oasr.model.StreamState`). A stream is *ready* when it has buffered at least
``state.samples_needed`` samples, or when its last audio arrived (then everything left is handed
over with ``is_last=True``). :meth:`step` takes the ready chunks of up to ``max_batch_size``
streams and calls ``model.stream_step`` once for all of them. Models promise results that do not
depend on which streams share a batch, so batching is invisible to callers.

**Policy** (docs/scheduler.md, "Streaming"): ready streams are served first come, first served
by the time their chunk became ready (then by arrival), so a stream is never overtaken by one
that became ready after it and waits at most ``ceil(ready before it / max_batch_size)`` steps:
starvation-free. With ``max_batch_wait_s > 0`` a step may *hold* to fill its batch: while fewer
than ``max_batch_size`` streams are ready, some live stream may still become ready, and the
oldest ready chunk has waited less than ``max_batch_wait_s``, :meth:`step` returns nothing and
:meth:`hold_remaining` says how long the hold lasts (the caller sleeps that long or until new
audio comes). A hold never outlasts ``max_batch_wait_s`` from the oldest ready chunk, which bounds
the latency it adds. :meth:`run` never holds.

**Memory**: a model with ``release_stream(state)`` (WeNet: its caches live in a
:class:`oasr.stream_cache.StreamCachePool`) gets every state back when its stream finishes, is
aborted or fails; :meth:`occupancy` reports live streams and the model's pool.

Thread-safety: every public method may be called from any thread. Feeding and aborting only touch
bookkeeping under a short lock; the model call runs under a separate step lock, so only one step
runs at a time and ``feed_chunk`` never waits for the model. ``add_request`` creates the stream's
state between steps (it may grow the model's cache pool, which a running step must not see). A stream aborted while its chunk is
in the model is dropped when the step returns (no update is reported for it) and its state is
released then.

No torch import here; numpy only.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from oasr.errors import InvalidRequestError, UnsupportedOptionError

if TYPE_CHECKING:
    from oasr.model import StreamingASRModel, StreamingUpdate
    from oasr.types import DecodingOptions, Transcript

__all__ = ["StreamingScheduler", "StreamInfo"]


@dataclass
class _Stream:
    rid: str
    state: Any
    seq: int
    chunks: list[np.ndarray] = field(default_factory=list)
    buffered: int = 0
    last_received: bool = False
    in_flight: bool = False
    finished: bool = False
    aborted: bool = False
    waiting_since: int = 0
    #: monotonic time the stream's current chunk became ready (FIFO key)
    ready_since: float = 0.0
    text: str = ""
    transcript: Transcript | None = None
    samples_in: int = 0


@dataclass(frozen=True)
class StreamInfo:
    rid: str
    buffered_samples: int
    samples_in: int
    last_received: bool
    finished: bool
    text: str


class StreamingScheduler:
    """Batch the ready chunks of all live streams into one ``model.stream_step`` call.

    ``model`` must satisfy :class:`oasr.model.StreamingASRModel` (capabilities.streaming True).
    ``max_batch_size``: most streams per model call. ``max_streams``: live streams allowed
    (``add_request`` raises beyond it; None = unlimited). ``new_state``: optional factory
    ``(options) -> StreamState`` replacing ``model.new_stream`` (e.g. to pass model-specific
    streaming parameters).
    """

    def __init__(self, model: StreamingASRModel, *, max_batch_size: int = 16,
                 max_streams: int | None = None,
                 new_state: Callable[[DecodingOptions], Any] | None = None,
                 max_batch_wait_s: float = 0.0) -> None:  # fmt: skip
        from oasr.model import StreamingASRModel

        if not isinstance(model, StreamingASRModel) or not model.capabilities.streaming:
            raise UnsupportedOptionError(
                f"{getattr(model, 'name', type(model).__name__)} cannot stream", param="service_mode"
            )
        if max_batch_size < 1:
            raise InvalidRequestError("max_batch_size must be >= 1", param="max_batch_size")
        if max_batch_wait_s < 0:
            raise InvalidRequestError("max_batch_wait_s must be >= 0", param="max_batch_wait_s")
        self.model = model
        self.max_batch_size = max_batch_size
        self.max_streams = max_streams
        #: longest a step holds to fill its batch, from the oldest ready chunk (0: never holds)
        self.max_batch_wait_s = max_batch_wait_s
        self._new_state = new_state or model.new_stream
        self._release_state = getattr(model, "release_stream", None)
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        #: ready streams (kept up to date by feed, step and abort: a step never scans them all)
        self._ready_set: dict[str, _Stream] = {}
        self._live = 0  # streams not finished
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self._clock = 0
        self._hold_until = 0.0
        #: steps run, streams advanced, holds, most streams in one step
        self.stats: dict[str, int] = {"steps": 0, "stream_updates": 0, "holds": 0, "max_batch": 0}

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, options: DecodingOptions | None = None, request_id: str | None = None) -> str:
        """Open a stream; returns its id (``request_id`` if given, else ``"s1"``, ``"s2"`` ...).
        The model validates ``options`` here (typed errors for unsupported options)."""
        from oasr.types import DecodingOptions

        options = options or DecodingOptions()
        with self._step_lock:  # a new state may grow the model's cache pool: never during a step
            state = self._new_state(options)
        with self._lock:
            live = self._live
            if self.max_streams is not None and live >= self.max_streams:
                raise InvalidRequestError(
                    f"too many live streams ({live}); this engine accepts {self.max_streams}",
                    param="max_streams",
                )
            rid = request_id if request_id is not None else f"s{next(self._ids)}"
            if rid in self._streams:
                raise InvalidRequestError(f"stream id {rid!r} is already in use", param="request_id")
            self._streams[rid] = _Stream(rid, state, next(self._seq), waiting_since=self._clock)
            self._live += 1
        return rid

    def feed_chunk(self, rid: str, audio: Any = None, is_last: bool = False) -> None:
        """Append mono float32 samples (at the model's rate; any length, None or empty allowed)
        to stream ``rid``; ``is_last=True`` marks the end of its audio."""
        from oasr.audio import as_mono_waveform

        a = np.zeros(0, np.float32) if audio is None else as_mono_waveform(np.asarray(audio).reshape(-1), "audio chunk")
        with self._lock:
            s = self._get(rid)
            if s.last_received:
                raise InvalidRequestError(f"stream {rid!r} already received its last chunk", param="audio")
            if a.size:
                s.chunks.append(a.copy())
                s.buffered += a.size
                s.samples_in += a.size
            if is_last:
                s.last_received = True
            self._update_ready(s, time.monotonic())

    def abort(self, rid: str) -> bool:
        """Drop stream ``rid`` and its state. Returns False if it was unknown or already done."""
        with self._lock:
            s = self._streams.pop(rid, None)
            if s is None:
                return False
            s.aborted = True
            self._ready_set.pop(rid, None)
            if not s.finished and not s.in_flight:
                self._live -= 1
            release = not s.in_flight and not s.finished  # in flight: released when the step returns
        if release:
            self._release(s)
        return not s.finished

    def _release(self, s: _Stream) -> None:
        if self._release_state is not None:
            try:
                self._release_state(s.state)
            except Exception:  # noqa: BLE001 - freeing never fails a caller
                pass

    def _get(self, rid: str) -> _Stream:
        s = self._streams.get(rid)
        if s is None:
            raise InvalidRequestError(f"unknown stream {rid!r}", param="request_id")
        if s.finished:
            raise InvalidRequestError(f"stream {rid!r} already finished", param="request_id")
        return s

    # -- stepping ------------------------------------------------------------------------------
    def _update_ready(self, s: _Stream, now: float) -> None:
        """Keep ``_ready_set`` true for ``s`` (lock held); a stream that becomes ready now gets
        ``ready_since = now``."""
        if self._ready(s):
            if s.rid not in self._ready_set:
                s.ready_since = now
                self._ready_set[s.rid] = s
        else:
            self._ready_set.pop(s.rid, None)

    def _ready(self, s: _Stream) -> bool:
        if s.finished or s.in_flight or s.aborted:
            return False
        if s.last_received:
            return True
        need = int(s.state.samples_needed)
        return s.buffered >= max(need, 1)

    def _take(self, s: _Stream) -> tuple[np.ndarray, bool]:
        need = int(s.state.samples_needed)
        size = s.buffered
        if s.last_received and (size <= max(need, 0) or need <= 0):
            take, last = size, True
        else:
            take, last = max(need, 0), False
            if take == 0:  # a model that needs nothing more: hand over what there is
                take = size
        take = min(take, size)
        # only the pieces the chunk covers are joined (one copy of ``take`` samples at most);
        # the rest stays as it was fed
        chunks, got, k = s.chunks, 0, 0
        while k < len(chunks) and got + chunks[k].size <= take:
            got += chunks[k].size
            k += 1
        head, rest = chunks[:k], chunks[k:]
        if got < take:  # the chunk ends inside ``rest[0]``
            cut = take - got
            head.append(rest[0][:cut])
            rest[0] = rest[0][cut:]
        if len(head) == 1:
            chunk = head[0]
        else:
            chunk = np.concatenate(head) if head else np.zeros(0, np.float32)
        s.chunks = rest
        s.buffered = size - take
        return chunk, last

    def step(self) -> list[tuple[str, StreamingUpdate]]:
        """Run one batched model call over the ready streams (up to ``max_batch_size``, those
        whose chunk became ready first). Returns ``(rid, StreamingUpdate)`` for each stream
        advanced; an empty list when nothing was ready or the step holds to fill its batch
        (:meth:`hold_remaining`)."""
        return self._step(hold=True)

    def hold_remaining(self) -> float:
        """Seconds the current hold lasts (0 when the last step did not hold)."""
        return max(0.0, self._hold_until - time.monotonic())

    def _step(self, hold: bool) -> list[tuple[str, StreamingUpdate]]:
        with self._step_lock:
            with self._lock:
                ready = list(self._ready_set.values())
                if not ready:
                    self._hold_until = 0.0
                    return []
                if hold and self.max_batch_wait_s > 0 and len(ready) < self.max_batch_size:
                    # the ready set is kept in the order streams became ready (monotonic
                    # times under the lock): its first entry waited longest
                    oldest = ready[0].ready_since
                    until = oldest + self.max_batch_wait_s
                    if time.monotonic() < until and len(ready) < self._live:
                        self._hold_until = until
                        self.stats["holds"] += 1
                        return []
                self._hold_until = 0.0
                ready.sort(key=lambda s: (s.ready_since, s.seq))
                batch = ready[: self.max_batch_size]
                work = []
                for s in batch:
                    del self._ready_set[s.rid]
                    chunk, last = self._take(s)
                    s.in_flight = True
                    work.append((s, chunk, last))
                self._clock += 1
            try:
                updates = self.model.stream_step(
                    [s.state for s, _, _ in work], [c for _, c, _ in work], [lst for _, _, lst in work]
                )
            except BaseException:
                with self._lock:
                    for s, _, _ in work:  # the states may be inconsistent: end these streams
                        s.in_flight = False
                        self._live -= 1  # live and in flight (an abort meanwhile left it counted)
                        s.finished = True
                        self._streams.pop(s.rid, None)
                for s, _, _ in work:
                    self._release(s)
                raise
            out: list[tuple[str, StreamingUpdate]] = []
            dropped = []
            with self._lock:
                now = time.monotonic()
                for (s, _, last), upd in zip(work, updates, strict=True):
                    s.in_flight = False
                    s.waiting_since = self._clock
                    if s.aborted:
                        self._live -= 1
                        dropped.append(s)
                        continue
                    s.text = upd.text
                    if upd.is_final or last:
                        s.finished = True
                        self._live -= 1
                        s.transcript = upd.transcript
                    else:  # more audio was buffered: ready again from now
                        self._update_ready(s, now)
                    out.append((s.rid, upd))
                self.stats["steps"] += 1
                self.stats["stream_updates"] += len(out)
                self.stats["max_batch"] = max(self.stats["max_batch"], len(work))
            for s in dropped:
                self._release(s)
            for (s, _, last), upd in zip(work, updates, strict=True):
                if not s.aborted and (upd.is_final or last):
                    self._release(s)  # idempotent: models release finished states themselves
            return out

    def run(self, callback: Callable[[str, StreamingUpdate], None] | None = None,
            ) -> dict[str, Transcript | None]:
        """Step until no stream can advance (every stream finished, or waiting for audio that
        has not arrived). Returns the final transcripts of the streams that finished during
        this call, by id; ``callback(rid, update)`` sees every update as it happens."""
        finals: dict[str, Transcript | None] = {}
        while True:
            updates = self._step(hold=False)
            if not updates:
                break
            for rid, upd in updates:
                if callback is not None:
                    callback(rid, upd)
                if upd.is_final:
                    finals[rid] = upd.transcript
        return finals

    # -- introspection -------------------------------------------------------------------------
    def result(self, rid: str) -> Transcript | None:
        """The final transcript of a finished stream (None while it runs)."""
        with self._lock:
            s = self._streams.get(rid)
            return None if s is None else s.transcript

    def release(self, rid: str) -> None:
        """Forget a finished stream (its transcript included); a live one is aborted."""
        with self._lock:
            s = self._streams.get(rid)
            if s is None or not s.finished:
                live = s is not None
            else:
                self._streams.pop(rid, None)
                live = False
        if live:
            self.abort(rid)

    def info(self, rid: str) -> StreamInfo:
        with self._lock:
            s = self._streams.get(rid)
            if s is None:
                raise InvalidRequestError(f"unknown stream {rid!r}", param="request_id")
            return StreamInfo(rid, s.buffered, s.samples_in, s.last_received, s.finished, s.text)

    def occupancy(self) -> dict[str, float]:
        """Gauges for metrics: live and ready streams, and the model's streaming cache pool
        (``pool_*``: streams, slots, blocks used / allocated, bytes) where it has one."""
        with self._lock:
            live, ready = self._live, len(self._ready_set)
        out: dict[str, float] = {"streams": live, "ready": ready}
        gauges = getattr(self.model, "stream_occupancy", None)
        if gauges is not None:
            out.update({f"pool_{k}": v for k, v in gauges().items()})
        return out

    @property
    def num_active(self) -> int:
        with self._lock:
            return self._live

    def has_ready(self) -> bool:
        with self._lock:
            return bool(self._ready_set)

"""The streaming engine loop: in ``--service-mode streaming`` one thread drives the engine's
streaming API for every live stream of the server.

Each turn of a realtime WebSocket or gRPC ``StreamingRecognize`` call is one engine streaming
request (:meth:`StreamingEngineLoop.open`). The event loop only posts commands (open, feed,
abort) and never waits; the loop thread applies them in order, then calls ``engine.step()``
while any stream has work. One step advances the ready chunks of all streams in one batched
model call, so concurrent streams share the model's batch. A step's ``StreamOutput``s go back
to their streams' event loop in one ``loop.call_soon_threadsafe`` per loop (not one per stream:
each wakes the loop through a socket write that may wait for the GIL): partial hypotheses to each
stream's ``on_partial`` callback, the final transcript (or an error) to its ``final`` future.

A step may *hold* to fill its batch (``--stream-batch-wait-ms``, the scheduler's
``max_batch_wait_s``): it advances nothing while fewer than a full batch of streams are ready and
the oldest ready chunk has waited less than the hold. The loop then sleeps until the hold ends or
a command arrives (new audio may complete the batch), and steps again.

The event loop and this thread share the GIL, and each lets go of it often (socket calls, numpy
over more than 500 elements, device waits); getting it back waits for the other thread's switch
interval, so the loop lowers the process's ``sys.setswitchinterval`` from Python's 5 ms to
:data:`SWITCH_INTERVAL_S` (1 ms) when it starts (unless something else changed it).

All streaming engine calls (``add_streaming_request``, ``feed_chunk``, ``step``, ``abort``) are
made from this one thread: whatever the engine promises about threads, nothing here needs it.
A stream leaves the engine when its final result arrives, when it is aborted (the client
cleared the turn, went away, was cancelled) and when the loop stops; ``open_streams`` counts
the streams the engine holds (``oasr_engine_streams`` in ``/metrics``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from oasr.scheduler import settle_torch_threads
from oasr_server.worker import BatchCallback, as_oasr_error

if TYPE_CHECKING:
    from oasr.engine import ASREngine, StreamOutput
    from oasr.types import DecodingOptions, Transcript

log = logging.getLogger("oasr_server.streams")

#: the process's ``sys.setswitchinterval`` once the streaming loop runs (Python's default 5 ms
#: unless something else changed it)
SWITCH_INTERVAL_S = 0.001
_PYTHON_SWITCH_INTERVAL_S = 0.005


@dataclass(eq=False)
class EngineStream:
    """One engine streaming request as its event loop sees it. ``final`` resolves to the
    final :class:`~oasr.types.Transcript` (or the stream's error); ``on_partial(text)`` gets
    every partial hypothesis before that, on the event loop."""

    rid: str
    loop: asyncio.AbstractEventLoop
    on_partial: Callable[[str], None]
    final: asyncio.Future[Transcript] = field(repr=False)
    #: event-loop side: aborted or answered; outputs still in flight are dropped
    closed: bool = False

    def _deliver(self, out: StreamOutput) -> None:
        if self.closed:
            return
        if not out.is_final:
            self.on_partial(out.text)
            return
        self.closed = True
        if not self.final.done():
            from oasr.types import Transcript

            transcript = out.transcript or Transcript(text=out.text, language=None, duration=0.0)
            self.final.set_result(transcript)

    def _fail(self, error: BaseException) -> None:
        if self.closed:
            return
        self.closed = True
        if not self.final.done():
            self.final.set_exception(error)


def _deliver_all(delivered: list[tuple[EngineStream, StreamOutput]]) -> None:
    """Event loop: one step's outputs, in order."""
    for stream, out in delivered:
        try:
            stream._deliver(out)
        except Exception:  # noqa: BLE001 - one stream's callback must not starve the others
            log.exception("delivering a streaming output failed")


def _merge_feeds(commands: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Loop thread: one wake-up's commands with each stream's successive ``feed``s (up to its
    last, and up to any other command of that stream) merged into one feed at the place of the
    first, their int16 pcm scaled to float32 (``decode_raw_pcm``'s values: scaling by 2**-15 is
    exact). The engine gets the same audio in fewer ``feed_chunk`` calls (each costs this
    thread the GIL for tens of us; when the steps fall behind, a stream's appends pile up
    between wake-ups); all the int16 of a wake-up is scaled in one numpy call (numpy lets go of
    the GIL above 500 elements, and getting it back waits for the event loop)."""
    import numpy as np

    from oasr_server.streaming import pcm16_as_float

    out: list[Any] = []
    runs: dict[EngineStream, list[Any]] = {}  # a stream's open run: ["feed", stream, parts, last]
    for command in commands:
        stream = command[1]
        audio = command[2] if command[0] == "feed" else None
        if command[0] != "feed" or not (audio is None or isinstance(audio, np.ndarray)):
            runs.pop(stream, None)  # (a feed of another type of array goes as it came)
            out.append(command)
            continue
        run = runs.get(stream)
        if run is None:
            run = runs[stream] = ["feed", stream, [], False]
            out.append(run)
        if audio is not None and len(audio):
            run[2].append(audio)
        if command[3]:  # its last: nothing may be merged after it
            run[3] = True
            del runs[stream]
    pcm = [a for c in out if isinstance(c, list) for a in c[2] if a.dtype.kind == "i"]
    scaled: dict[int, Any] = {}
    if pcm:
        flat = pcm16_as_float(np.concatenate(pcm))
        at = 0
        for a in pcm:
            scaled[id(a)] = flat[at : at + len(a)]
            at += len(a)
    result: list[tuple[Any, ...]] = []
    for c in out:
        if isinstance(c, list):
            parts = [scaled.get(id(a), a) for a in c[2]]
            audio = None if not parts else parts[0] if len(parts) == 1 else np.concatenate(parts)
            c = ("feed", c[1], audio, c[3])
        result.append(c)
    return result


def _retrieve(future: asyncio.Future[Any]) -> None:
    # a stream dropped before its turn was committed never awaits its final: mark the error seen
    if not future.cancelled():
        future.exception()


class StreamingEngineLoop:
    def __init__(self, engine: ASREngine, *, on_batch: BatchCallback | None = None) -> None:
        self.engine = engine
        self._on_batch = on_batch
        self._cond = threading.Condition()
        self._commands: deque[tuple[Any, ...]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: loop thread only: the streams the engine holds, by request id
        self._live: dict[str, EngineStream] = {}
        self._ids = itertools.count(1)
        #: the event loops a wake-up of the loop thread is scheduled on
        self._wake_on: set[asyncio.AbstractEventLoop] = set()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        if sys.getswitchinterval() == _PYTHON_SWITCH_INTERVAL_S:  # (not set by someone else)
            # the event loop and this thread both run Python and both let go of the GIL
            # often (socket calls, numpy over > 500 elements, device waits); a thread that
            # let go waits for the other's switch interval to get it back, 5 ms by default:
            # per append on the event loop, per numpy call of a large step here
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="oasr-stream-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Abort every stream (their finals fail with ``model_not_ready``) and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    @property
    def open_streams(self) -> int:
        """Streaming requests the engine holds now."""
        return len(self._live)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- event-loop side (never blocks) ------------------------------------------------------
    def open(self, options: DecodingOptions, on_partial: Callable[[str], None]) -> EngineStream:
        loop = asyncio.get_running_loop()
        final: asyncio.Future[Transcript] = loop.create_future()
        final.add_done_callback(_retrieve)
        stream = EngineStream(f"rt{next(self._ids)}", loop, on_partial, final)
        self._post(stream, ("open", stream, options))
        return stream

    def feed(self, stream: EngineStream, audio: Any, is_last: bool = False) -> None:
        """Append model-rate samples: float32, or int16 pcm (scaled by 2**-15 in the loop
        thread, off the event loop); ``audio`` may be None with ``is_last``."""
        self._post(stream, ("feed", stream, audio, is_last))

    def abort(self, stream: EngineStream) -> None:
        """Drop the stream (idempotent); its final is never delivered."""
        if stream.closed and stream.final.done():
            return  # answered: the loop already released it
        stream.closed = True
        self._post(stream, ("abort", stream))

    def _post(self, stream: EngineStream, command: tuple[Any, ...]) -> None:
        with self._cond:
            if not self._stopping:
                self._commands.append(command)
                # one wake-up of the loop thread per event-loop turn, not one per command: a
                # woken thread takes the GIL from the event loop for a step attempt, and
                # hundreds of streams post thousands of appends a second; the commands of one
                # turn of the event loop (every socket it read) go over together
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # not on an event loop: wake it now
                    loop = None
                if loop is None:
                    self._cond.notify()
                elif loop not in self._wake_on:
                    self._wake_on.add(loop)
                    loop.call_soon(self._wake, loop)
                return
        from oasr_server.errors import NotReadyError

        stream._fail(NotReadyError("the server is shutting down; retry on another instance"))

    def _wake(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._cond:
            self._wake_on.discard(loop)
            self._cond.notify()

    # -- loop thread -------------------------------------------------------------------------
    def _run(self) -> None:
        settle_torch_threads()
        busy, hold = False, 0.0
        while True:
            with self._cond:
                while not self._commands and not busy and not self._stopping:
                    if hold > 0:  # the step held to fill its batch: step again when it ends
                        self._cond.wait(hold)
                        break
                    self._cond.wait()
                commands = list(self._commands)
                self._commands.clear()
                stopping = self._stopping
            commands = _merge_feeds(commands)
            for command in commands:
                try:
                    self._apply(*command)
                except BaseException:  # noqa: BLE001 - never let the loop die
                    log.exception("streaming engine loop: command %s failed", command[0])
            if stopping:
                break
            try:
                busy = self._step()
                hold = 0.0 if busy else self._hold_remaining()
            except BaseException:  # noqa: BLE001
                log.exception("streaming engine loop: unexpected failure")
                busy, hold = False, 0.0
        from oasr_server.errors import NotReadyError

        for stream in list(self._live.values()):
            self._release(stream)
            self._fail(stream, NotReadyError("the server is shutting down"))

    def _apply(self, kind: str, stream: EngineStream, *args: Any) -> None:
        if kind == "open":
            (options,) = args
            try:
                self.engine.add_streaming_request(options, request_id=stream.rid)
            except BaseException as exc:  # noqa: BLE001 - this stream fails alone
                self._fail(stream, exc)
                return
            self._live[stream.rid] = stream
        elif kind == "feed":
            audio, is_last = args
            if stream.rid not in self._live:  # aborted, or its open failed
                return
            try:
                self.engine.feed_chunk(stream.rid, audio, is_last)
            except BaseException as exc:  # noqa: BLE001
                self._release(stream)
                self._fail(stream, exc)
        elif kind == "abort":
            if stream.rid in self._live:
                self._release(stream)

    def _release(self, stream: EngineStream) -> None:
        self._live.pop(stream.rid, None)
        try:
            self.engine.abort(stream.rid)  # also forgets a finished stream's transcript
        except Exception:  # noqa: BLE001 - best effort
            log.debug("abort of %s failed", stream.rid, exc_info=True)

    def _step(self) -> bool:
        """One engine step; True when it advanced any stream (step again at once)."""
        if not self._live:
            return False
        started = time.monotonic()
        try:
            outputs = self.engine.step()
        except BaseException as exc:  # noqa: BLE001 - fail the streams of that batch
            self._step_failed(exc)
            return bool(self._live)
        if outputs and self._on_batch is not None:
            try:
                self._on_batch(len(outputs), time.monotonic() - started)
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.exception("batch metrics callback failed")
        # one hand-over per event loop for the whole step: each call_soon_threadsafe writes to
        # the loop's wake-up socket, and every such write may wait for the GIL while the event
        # loop holds it; hundreds of streams per step made that a queue of its own
        batches: dict[asyncio.AbstractEventLoop, list[tuple[EngineStream, StreamOutput]]] = {}
        for out in outputs:
            stream = self._live.get(out.request_id)
            if stream is None:
                continue
            if out.is_final:
                self._release(stream)
            batches.setdefault(stream.loop, []).append((stream, out))
        for loop, delivered in batches.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, delivered)
            except RuntimeError:  # its event loop is closed: nobody is listening
                for stream, _ in delivered:
                    if stream.rid in self._live:
                        self._release(stream)
        return bool(outputs)

    def _hold_remaining(self) -> float:
        """Seconds the engine's last step holds to fill its batch (``max_batch_wait_s``; 0: it
        did not hold). New commands end the wait early: the next step decides again."""
        if not self._live:
            return 0.0
        hold = getattr(getattr(self.engine, "streaming", None), "hold_remaining", None)
        return float(hold()) if hold is not None else 0.0

    def _step_failed(self, exc: BaseException) -> None:
        # the engine ends the streams whose chunk was in the failed call; the others go on (if it
        # ended none, end them all rather than fail the same step forever)
        error = as_oasr_error(exc)
        scheduler = getattr(self.engine, "streaming", None)
        dropped = []
        for stream in self._live.values():
            try:
                scheduler.info(stream.rid)  # type: ignore[union-attr]
            except Exception:  # noqa: BLE001 - unknown to the engine now
                dropped.append(stream)
        for stream in dropped or list(self._live.values()):
            self._release(stream)
            self._fail(stream, error)

    def _fail(self, stream: EngineStream, error: BaseException) -> None:
        """End ``stream`` with ``error`` on its event loop (outputs go through ``_deliver_all``)."""
        try:
            stream.loop.call_soon_threadsafe(stream._fail, as_oasr_error(error))
        except RuntimeError:  # its event loop is closed: nobody is listening
            if stream.rid in self._live:
                self._release(stream)

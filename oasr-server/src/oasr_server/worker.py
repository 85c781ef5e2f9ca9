"""The engine worker: admission control between the event loop and the engine's scheduler.

Requests enter a queue (``submit`` never blocks). When the requests waiting here and in the
engine's scheduler reach ``max_queue``, ``submit`` raises
:class:`~oasr.errors.EngineOverloadedError` (503 ``overloaded`` with ``Retry-After``). One worker
thread takes the oldest job and hands its inputs to the engine through its public API
(``engine.submit_many``: a job's inputs arrive together, so a chunked upload shares a batch), as
soon as fewer than ``max_concurrency`` inputs are in the engine. The engine's scheduler does all
the batching (length buckets, one options set per model call, continuous batching where the model
offers it) and isolates a failing input; the worker never groups requests itself. Results go
back to the waiting coroutines through ``loop.call_soon_threadsafe``. A request that times out or
whose client leaves is skipped, or aborted in the engine (``engine.abort``).

Guarantees: every accepted request is answered exactly once (a result, its own error, or, when
the caller gave up first, nothing is computed for it); ``stop`` finishes everything accepted
before it returns.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from oasr.errors import EngineOverloadedError, OASRError

if TYPE_CHECKING:
    import numpy as np

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, Transcript

log = logging.getLogger("oasr_server")

_STOP = object()


@dataclass(eq=False)
class Job:
    #: one input, or (``multi``) a list of inputs answered with a list of transcripts; a multi
    #: job takes one queue slot and its inputs reach the engine together
    audio: np.ndarray | list[np.ndarray]
    options: DecodingOptions
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Transcript]
    enqueued_at: float = field(default_factory=time.monotonic)
    #: set by the caller when it stopped waiting (timeout, disconnect): the work is skipped
    abandoned: bool = False
    multi: bool = False
    #: the engine futures of this job's inputs (for abort)
    engine_futures: list[Any] = field(default_factory=list)
    #: ``on_partial(k, text)``: each new piece of input ``k``'s text as it is decoded (token
    #: streaming; called in the scheduler's thread; families without partials never call it)
    on_partial: Callable[[int, str], None] | None = None
    #: the worker thread took it off the queue (its inputs are read from then on)
    taken: bool = False

    @property
    def inputs(self) -> list[np.ndarray]:
        return list(self.audio) if self.multi else [self.audio]  # type: ignore[list-item]


BatchCallback = Callable[[int, float], None]


class EngineWorker:
    def __init__(
        self,
        engine: ASREngine,
        *,
        max_queue: int,
        max_batch_size: int | None = None,
        on_batch: BatchCallback | None = None,
        max_concurrency: int | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size or engine.config.max_batch_size
        if max_concurrency is None:
            from oasr.scheduler import BatchExecutor

            # a BatchExecutor runs one batch per step: room for the next batch to gather in the
            # scheduler while the current one runs (else requests trickle in as batches of
            # one); a continuous executor refills its rows as they free
            whole_batches = isinstance(engine.scheduler.executor, BatchExecutor)
            max_concurrency = self.max_batch_size * (2 if whole_batches else 1)
        #: most inputs in the engine at once (running or waiting in its scheduler)
        self.max_concurrency = max_concurrency
        #: most requests waiting (here and in the engine's scheduler) before ``submit`` refuses
        self.max_queue = max_queue
        self._slots = threading.Condition()
        self._engine_active = 0
        self._queue: queue.Queue[Any] = queue.Queue()
        self._on_batch = on_batch
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._submit_lock = threading.Lock()
        #: requests taken off the queue and not answered yet
        self.in_flight = 0
        #: recent seconds from a job's hand-off to the engine to its answer (moving average)
        self.service_s = 0.0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        self.engine.scheduler  # noqa: B018 - built now (executor pools), not on a first request
        self._attach_step_metrics()
        self._thread = threading.Thread(target=self._run, name="oasr-engine-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, finish every accepted request, end the thread (blocking)."""
        with self._submit_lock:
            self._accepting = False
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def depth(self) -> int:
        """Requests waiting: in this queue, and handed to the engine but not running yet."""
        return self._queue.qsize() + self.engine.scheduler.num_waiting

    def retry_after(self, floor: int, cap: int = 60) -> int:
        """Seconds a refused client should wait (``Retry-After``): the time the engine needs for
        the requests already waiting, from their recent service time and how many run at once,
        at least ``floor`` and at most ``cap``. A fixed 1 s under sustained overload makes every
        client retry into the same full queue."""
        import math

        waves = math.ceil((self.depth + 1) / max(1, self.max_concurrency))
        return int(min(cap, max(floor, math.ceil(waves * self.service_s))))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- submission (event-loop side; never blocks) ------------------------------------------
    def submit(
        self,
        audio: np.ndarray | list[np.ndarray],
        options: DecodingOptions,
        *,
        multi: bool = False,
        on_partial: Callable[[int, str], None] | None = None,
    ) -> Job:
        """Queue one input (or, with ``multi``, a list of inputs answered by a list);
        ``on_partial``: see :attr:`Job.on_partial`."""
        loop = asyncio.get_running_loop()
        job = Job(audio, options, loop, loop.create_future(), multi=multi, on_partial=on_partial)
        with self._submit_lock:
            if not self._accepting:
                from oasr_server.errors import NotReadyError

                raise NotReadyError("the server is shutting down; retry on another instance")
            if self.depth >= self.max_queue:
                raise EngineOverloadedError(
                    f"the server is busy ({self.max_queue} requests are already waiting); "
                    "retry after the time given in Retry-After"
                )
            self._queue.put_nowait(job)
        return job

    def abandon(self, job: Job) -> None:
        """The caller stopped waiting: skip the job, or abort its inputs in the engine (the
        abort runs off the event loop: it may wait for the end of a scheduler step)."""
        job.abandoned = True
        if not job.taken:
            # a job still queued here never runs: its audio need not wait in the queue with it
            # (a stream that ended, a client gone: their audio is freed now)
            import numpy as np

            job.audio = [] if job.multi else np.zeros(0, np.float32)
        futures = [f for f in job.engine_futures if not f.done()]
        if not futures:
            return

        def abort() -> None:
            for f in futures:
                try:
                    self.engine.abort(f.rid)
                except Exception:  # noqa: BLE001 - best effort
                    log.debug("abort failed", exc_info=True)

        threading.Thread(target=abort, name="oasr-abort", daemon=True).start()

    # -- worker thread -----------------------------------------------------------------------
    def _attach_step_metrics(self) -> None:
        if self._on_batch is None:
            return
        sched = self.engine.scheduler  # builds the scheduler and its executor
        last = [time.monotonic()]
        on_batch = self._on_batch

        def on_step(s: Any) -> None:
            # the requests in the engine during this step: still running + finished by it (the
            # hook runs before the finished ones are answered, so a client that has its answer
            # finds its step in the metrics)
            now = time.monotonic()
            running = s.executor.num_running + s.last_step_finished
            try:
                if running:
                    on_batch(running, now - last[0])
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.exception("batch metrics callback failed")
            last[0] = now

        sched.on_step = on_step

    def _run(self) -> None:
        while True:
            # nothing of the previous job stays referenced here while the queue is empty (its
            # audio is freed when its request ends: --max-pending-audio-seconds counts it)
            item = job = inputs = None
            item = self._queue.get()
            if item is _STOP:
                break
            job = item
            job.taken = True
            if job.abandoned:
                continue
            inputs = job.inputs
            n = len(inputs)
            with self._slots:
                # a job of n inputs waits for n free slots (or for an empty engine)
                while self._engine_active and self._engine_active + n > self.max_concurrency:
                    self._slots.wait()
                if job.abandoned:
                    continue
                self._engine_active += n
                self.in_flight = self._engine_active
            try:
                self._submit_job(job, inputs)
            except BaseException:  # noqa: BLE001 - never let the worker die
                log.exception("engine worker: unexpected failure")
                from oasr_server.errors import EngineFailureError

                self._release(n)
                _deliver(job, error=EngineFailureError("internal error in the engine worker"))
        # finish every accepted request before stopping
        with self._slots:
            while self._engine_active:
                self._slots.wait()

    def _release(self, n: int) -> None:
        with self._slots:
            self._engine_active -= n
            self.in_flight = self._engine_active
            self._slots.notify_all()

    def _submit_job(self, job: Job, inputs: list[np.ndarray]) -> None:
        n = len(inputs)
        results: list[Any] = [None] * n
        remaining = [n]
        lock = threading.Lock()
        errors: list[BaseException] = []

        handed = time.monotonic()

        def finish() -> None:
            # the engine futures' callbacks refer back to this job: break the cycle, so its
            # audio is freed as soon as its request ends (not at the next GC)
            job.engine_futures = []
            took = time.monotonic() - handed
            self.service_s = took if not self.service_s else 0.8 * self.service_s + 0.2 * took
            self._release(n)
            if errors:
                _deliver(job, error=as_oasr_error(errors[0]))
            else:
                _deliver(job, result=results if job.multi else results[0])

        def on_done(k: int, fut: Any) -> None:
            exc = fut.exception()
            with lock:
                if exc is not None:
                    errors.append(exc)
                else:
                    results[k] = fut.result()
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                finish()

        try:
            if job.on_partial is not None:
                futures = self.engine.submit_many(inputs, job.options, on_partial=job.on_partial)
            else:
                futures = self.engine.submit_many(inputs, job.options)
        except BaseException as exc:  # noqa: BLE001 - this request fails alone (nothing queued)
            errors.append(exc)
            finish()
            return
        job.engine_futures.extend(futures)
        for k, fut in enumerate(futures):
            fut.add_done_callback(partial(on_done, k))
        if job.abandoned:
            self.abandon(job)


def as_oasr_error(exc: BaseException) -> BaseException:
    if isinstance(exc, OASRError):
        return exc
    log.error("engine failed on a request: %s: %s", type(exc).__name__, exc)
    from oasr_server.errors import EngineFailureError

    return EngineFailureError(
        f"the model failed on this request ({type(exc).__name__}); the details are in the server log"
    )


def _deliver(job: Job, *, result: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if job.future.done():
            return
        if job.abandoned:  # nobody waits: no "exception was never retrieved" in the log
            job.future.cancel()
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

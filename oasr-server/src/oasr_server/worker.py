"""The engine worker: one dedicated thread owns the engine; the event loop never runs model code.

Requests enter a bounded queue (``submit`` never blocks: a full queue raises
:class:`~oasr.errors.EngineOverloadedError`, answered 429). The worker takes the oldest waiting
request, drains whatever else is waiting (up to ``max_batch_size``), groups the requests whose
decoding options are equal and runs each group as one ``engine.transcribe_arrays`` call. Results
go back to the waiting coroutines through ``loop.call_soon_threadsafe``.

Two ways to run the engine (chosen once, when the worker is built):

* **scheduler** (offline engines whose model plugin provides a continuous-batching executor,
  Whisper included): the worker thread hands each request's inputs to ``engine.submit``, so
  requests join the engine scheduler's continuous batch as soon as a row frees up. At most
  ``max_concurrency`` requests are in the engine at once; the rest wait in the bounded queue.
  A request that times out or whose client leaves is aborted in the engine (``engine.abort``).
* **batch** (every other model, and streaming-mode engines): the direct path described above.

Guarantees: every accepted request is answered exactly once (a result, its own error, or, when
the caller gave up first, nothing is computed for it); a failing batch is retried one request at
a time so one bad input cannot fail its neighbours; ``stop`` finishes everything accepted before
it returns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from oasr.errors import EngineOverloadedError, OASRError

if TYPE_CHECKING:
    import numpy as np

    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, Transcript

log = logging.getLogger("oasr_server")

_STOP = object()


def options_key(options: DecodingOptions) -> str:
    """Requests whose keys are equal may share one engine call."""
    return json.dumps(asdict(options), sort_keys=True, default=repr)


@dataclass(eq=False)
class Job:
    #: one input, or (``multi``) a list of inputs answered with a list of transcripts; a multi
    #: job takes one queue slot and its inputs run in the same engine call as its group
    audio: np.ndarray | list[np.ndarray]
    options: DecodingOptions
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Transcript]
    key: str = ""
    enqueued_at: float = field(default_factory=time.monotonic)
    #: set by the caller when it stopped waiting (timeout, disconnect): the work is skipped
    abandoned: bool = False
    multi: bool = False
    #: scheduler mode: the engine futures of this job's inputs (for abort)
    engine_futures: list[Any] = field(default_factory=list)

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
        use_scheduler: bool | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size or engine.config.max_batch_size
        #: most requests in the engine at once (scheduler mode)
        self.max_concurrency = max_concurrency or self.max_batch_size
        if use_scheduler is None:
            use_scheduler = scheduler_available(engine)
        #: "scheduler" or "batch" (see the module docstring)
        self.mode = "scheduler" if use_scheduler else "batch"
        self._slots = threading.Condition()
        self._engine_active = 0
        self._inputs_finished = 0
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._on_batch = on_batch
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._submit_lock = threading.Lock()
        #: requests taken off the queue and not answered yet
        self.in_flight = 0

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._accepting = True
        if self.mode == "scheduler":
            self._attach_step_metrics()
        target = self._run_scheduled if self.mode == "scheduler" else self._run
        self._thread = threading.Thread(target=target, name="oasr-engine-worker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, finish every accepted request, end the thread (blocking)."""
        with self._submit_lock:
            self._accepting = False
        if self._thread is None:
            return
        self._queue.put(_STOP)  # blocks only while the worker is still draining a full queue
        self._thread.join(timeout)
        self._thread = None

    @property
    def depth(self) -> int:
        """Requests waiting in the queue (not yet taken by the worker)."""
        return self._queue.qsize()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- submission (event-loop side; never blocks) ------------------------------------------
    def submit(
        self, audio: np.ndarray | list[np.ndarray], options: DecodingOptions, *, multi: bool = False
    ) -> Job:
        """Queue one input (or, with ``multi``, a list of inputs answered by a list)."""
        loop = asyncio.get_running_loop()
        job = Job(audio, options, loop, loop.create_future(), options_key(options), multi=multi)
        with self._submit_lock:
            if not self._accepting:
                from oasr_server.errors import NotReadyError

                raise NotReadyError("the server is shutting down; retry on another instance")
            try:
                self._queue.put_nowait(job)
            except queue.Full:
                raise EngineOverloadedError(
                    f"the server is busy ({self._queue.maxsize} requests are already waiting); "
                    "retry after the time given in Retry-After"
                ) from None
        return job

    def abandon(self, job: Job) -> None:
        """The caller stopped waiting: skip the job, or abort its inputs in the engine (the
        abort runs off the event loop: it may wait for the end of a scheduler step)."""
        job.abandoned = True
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

    # -- worker thread: scheduler mode -------------------------------------------------------
    def _attach_step_metrics(self) -> None:
        if self._on_batch is None:
            return
        try:
            sched = self.engine._offline("submit")  # builds the scheduler and its executor
        except Exception:  # noqa: BLE001
            return
        last = [time.monotonic()]
        seen = [0]
        on_batch = self._on_batch

        def on_step(s: Any) -> None:
            # the requests in the engine during this step: still running + finished by it
            now = time.monotonic()
            finished, seen[0] = self._inputs_finished - seen[0], self._inputs_finished
            running = s.executor.num_running + finished
            try:
                if running:
                    on_batch(running, now - last[0])
            except Exception:  # noqa: BLE001 - metrics must never break serving
                log.exception("batch metrics callback failed")
            last[0] = now

        sched.on_step = on_step

    def _run_scheduled(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            job: Job = item
            if job.abandoned:
                continue
            n = len(job.inputs)
            with self._slots:
                # a job of n inputs waits for n free slots (or for an empty engine)
                while self._engine_active and self._engine_active + n > self.max_concurrency:
                    self._slots.wait()
                if job.abandoned:
                    continue
                self._engine_active += n
                self.in_flight = self._engine_active
            try:
                self._submit_job(job, n)
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

    def _submit_job(self, job: Job, n: int) -> None:
        inputs = job.inputs
        results: list[Any] = [None] * n
        remaining = [n]
        lock = threading.Lock()
        errors: list[BaseException] = []

        def finish() -> None:
            self._release(n)
            if errors:
                _deliver(job, error=as_oasr_error(errors[0]))
            else:
                _deliver(job, result=results if job.multi else results[0])

        def on_done(k: int, fut: Any) -> None:
            exc = fut.exception()
            self._inputs_finished += 1  # read by the step metrics (same scheduler thread)
            with lock:
                if exc is not None:
                    errors.append(exc)
                else:
                    results[k] = fut.result()
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                finish()

        submitted = 0
        try:
            for k, audio in enumerate(inputs):
                fut = self.engine.submit(audio, job.options)
                job.engine_futures.append(fut)
                submitted += 1
                fut.add_done_callback(partial(on_done, k))
        except BaseException as exc:  # noqa: BLE001 - this request fails alone
            with lock:
                errors.append(exc)
                unsent = n - submitted
                remaining[0] -= unsent
                last = remaining[0] == 0
            for f in job.engine_futures:
                if not f.done():
                    try:
                        self.engine.abort(f.rid)
                    except Exception:  # noqa: BLE001
                        pass
            if last:
                finish()
            return
        if job.abandoned:
            self.abandon(job)

    # -- worker thread: batch mode -----------------------------------------------------------
    def _run(self) -> None:
        fix_torch_threads()
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is _STOP:
                break
            batch: list[Job] = [item]
            while len(batch) < self.max_batch_size:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is _STOP:
                    stopping = True
                    break
                batch.append(nxt)
            self.in_flight = len(batch)
            try:
                self._process(batch)
            except BaseException:  # noqa: BLE001 - never let the worker die
                log.exception("engine worker: unexpected failure")
                from oasr_server.errors import EngineFailureError

                for job in batch:
                    _deliver(job, error=EngineFailureError("internal error in the engine worker"))
            finally:
                self.in_flight = 0

    def _process(self, batch: list[Job]) -> None:
        groups: dict[str, list[Job]] = {}
        for job in batch:
            if job.abandoned:
                continue
            groups.setdefault(job.key, []).append(job)
        for jobs in groups.values():
            jobs = [j for j in jobs if not j.abandoned]
            if jobs:
                self._run_group(jobs)

    def _run_group(self, jobs: list[Job]) -> None:
        started = time.monotonic()
        try:
            inputs = [x for j in jobs for x in j.inputs]
            results = self.engine.transcribe_arrays(inputs, jobs[0].options) if inputs else []
        except BaseException as exc:  # noqa: BLE001
            if len(jobs) > 1 and not isinstance(exc, OASRError):
                # isolate the request that breaks the batch; the others still get answers
                for job in jobs:
                    if not job.abandoned:
                        self._run_group([job])
                return
            if not isinstance(exc, OASRError):
                log.exception("engine failed on a request")
                from oasr_server.errors import EngineFailureError

                exc = EngineFailureError(
                    f"the model failed on this request ({type(exc).__name__}); "
                    "the details are in the server log"
                )
            for job in jobs:
                _deliver(job, error=exc)
            return
        finally:
            if self._on_batch is not None:
                try:
                    self._on_batch(len(jobs), time.monotonic() - started)
                except Exception:  # noqa: BLE001 - metrics must never break serving
                    log.exception("batch metrics callback failed")
        pos = 0
        for job in jobs:
            n = len(job.inputs)
            part = results[pos : pos + n]
            pos += n
            _deliver(job, result=list(part) if job.multi else part[0])


def scheduler_available(engine: Any) -> bool:
    """Whether ``engine`` offers ``submit`` with a continuous-batching executor (offline mode and
    a model plugin that provides one); else the worker uses the direct batch path."""
    config = getattr(engine, "config", None)
    if getattr(config, "service_mode", "offline") != "offline" or not hasattr(engine, "submit"):
        return False
    try:
        from oasr.scheduler import BatchExecutor

        sched = engine._offline("submit")
    except Exception:  # noqa: BLE001 - no scheduler: the direct path
        log.debug("engine scheduler unavailable", exc_info=True)
        return False
    return not isinstance(sched.executor, BatchExecutor)


def fix_torch_threads() -> None:
    """Fix the calling (model) thread's torch intra-op thread count now, from the process
    setting: threads started later (the VAD threads) may change the default they pick up."""
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        try:
            torch.get_num_threads()
        except Exception:  # noqa: BLE001 - only an optimisation
            pass


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
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    try:
        job.loop.call_soon_threadsafe(settle)
    except RuntimeError:  # the loop is closed: nobody is waiting any more
        pass

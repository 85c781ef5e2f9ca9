"""The offline request scheduler: requests from many callers, batched together.

:class:`Scheduler` owns a waiting queue and an :class:`Executor` (the model-specific part). Each
*step* it admits waiting requests into the executor and lets the executor advance everything it
runs by one unit of work, then resolves the futures of the requests that finished:

* admission is **length-bucketed** (waiting requests are considered shortest bucket first, so
  similar lengths share a batch and short requests are not stuck behind long ones);
* the executor says whether a request fits *now* (free batch slot, enough KV-cache blocks):
  admission never over-commits memory, a flood of requests waits in the queue;
* **starvation bound**: a request that has waited ``max_wait_steps`` steps is *starved*; starved
  requests are admitted oldest first before anything else, and while the oldest starved request
  does not fit nothing younger is admitted (its room is freed by the running requests finishing);
* **errors are per request**: a request the executor refuses or fails completes its own future
  with the exception; the others go on.

Two executors exist: :class:`BatchExecutor` here (any :class:`oasr.model.ASRModel`: one
``model.transcribe`` call per admitted batch) and model plugins' continuous-batching executors
(Whisper: ``WhisperASR.make_executor``), found by :func:`executor_for`.

Thread-safety: :meth:`Scheduler.submit` and :meth:`Scheduler.abort` may be called from any thread;
steps run in one thread (the scheduler thread started by :meth:`Scheduler.start`, or the caller of
:meth:`Scheduler.run_until_idle`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from oasr.errors import EngineBusyError, EngineOverloadedError, InvalidRequestError, OASRError
from oasr.model import HoldsExtraRequests, SupportsExecutor

if TYPE_CHECKING:
    import numpy as np

    from oasr.model import ASRModel
    from oasr.types import DecodingOptions, Transcript

__all__ = [
    "BatchExecutor",
    "EngineBusyError",
    "EngineOverloadedError",
    "Executor",
    "Request",
    "RequestAbortedError",
    "Scheduler",
    "SchedulerConfig",
    "executor_for",
]

log = logging.getLogger("oasr.scheduler")


class RequestAbortedError(OASRError):
    """The request was aborted before it finished."""

    http_status = 499
    code = "request_aborted"
    error_type = "invalid_request_error"


@dataclass
class SchedulerConfig:
    #: most requests running at once (the decoder batch of a continuous executor)
    max_batch_size: int = 16
    #: starvation bound, in scheduler steps (see the module docstring)
    max_wait_steps: int = 256
    #: most requests waiting (None: unbounded); beyond it ``submit`` raises
    #: EngineOverloadedError (503, ``overloaded``; ``EngineBusyError`` is its old name)
    max_queue: int | None = None
    #: width of a length bucket, seconds of audio
    bucket_seconds: float = 5.0
    #: KV-cache memory budget in bytes for continuous executors (None: room for a full batch)
    kv_cache_bytes: int | None = None
    #: token positions per KV-cache block
    block_size: int = 16
    #: CUDA-graph capture of the decoder step (None: on when the model runs on CUDA)
    cuda_graphs: bool | None = None
    #: the autoregressive executor's self-attention KV cache: None (the model's dtype) or
    #: "fp8" (float8 e4m3 with a scale per key/value vector; EngineConfig.kv_cache_dtype)
    kv_cache_dtype: str | None = None
    #: most windows per encoder call (None: max_batch_size)
    max_encoder_batch: int | None = None
    #: continuous executors: while requests run, admit new ones only when this many rows are
    #: free (None: half of ``encoder_lookahead`` where windows are encoded ahead, else
    #: max_batch_size // 8; at least 1); 1 = refill every freed row at once
    min_admit_group: int | None = None
    #: continuous executors: windows encoded ahead of a free decoder row, so the next group's
    #: encoder runs while the current rows decode (None: max_batch_size on CUDA, where the
    #: encoder runs on a second stream beside the decode steps; 0 on CPU)
    encoder_lookahead: int | None = None
    #: continuous executors: most seconds of audio a driver's admission scan (Whisper's VAD
    #: gate) covers per step, summed over the requests being scanned; the rest continues in
    #: later steps, so one step stays short whatever was admitted (None: the family's default,
    #: Whisper 30 s on CPU, 3600 s on CUDA)
    gate_seconds_per_step: float | None = None
    #: streaming engines: longest a streaming step holds to fill its batch, in seconds from the
    #: oldest ready chunk (``StreamingScheduler.max_batch_wait_s``; 0: never holds; a few ms pay
    #: off on a GPU, where a step's cost hardly grows with its batch)
    stream_batch_wait_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise InvalidRequestError("max_batch_size must be >= 1", param="max_batch_size")
        if not self.stream_batch_wait_s >= 0:
            raise InvalidRequestError("stream_batch_wait_s must be >= 0", param="stream_batch_wait_s")
        if self.max_wait_steps < 0:
            raise InvalidRequestError("max_wait_steps must be >= 0", param="max_wait_steps")
        if self.gate_seconds_per_step is not None and not self.gate_seconds_per_step > 0:
            raise InvalidRequestError("gate_seconds_per_step must be > 0", param="gate_seconds_per_step")


@dataclass
class Request:
    rid: str
    audio: np.ndarray
    options: DecodingOptions
    seq: int
    arrival_step: int
    future: Future = field(default_factory=Future)
    admitted_step: int | None = None
    arrival_time: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None
    #: called with the share (0..1) of this request's work done, by executors that can tell
    #: (``BatchExecutor``: from the model's progress during its batch)
    on_progress: Callable[[float], None] | None = None
    #: called with each new piece of text as it is decoded (token-streaming partials), by
    #: executors whose family can tell (the autoregressive executor's ``StreamsPartials``
    #: drivers); the final transcript still comes through the future
    on_partial: Callable[[str], None] | None = None
    #: the length bucket admission orders by (set by the scheduler on submission)
    bucket: int = 0

    @property
    def num_samples(self) -> int:
        return int(self.audio.shape[-1])


class Executor(Protocol):
    """The model-specific half of the scheduler."""

    def try_admit(self, request: Request) -> bool:
        """Take ``request`` if it fits now (slot and memory); False leaves it waiting. May raise a
        typed error for a request that can never run (it then fails alone). An executor whose
        refusal holds for every request this step may say so with an attribute
        ``refuses_all = True``: the scheduler then asks no other waiting request that step."""
        ...

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        """Advance the admitted requests by one unit of work; return those that finished."""
        ...

    def abort(self, request: Request) -> bool:
        """Drop an admitted request (free its memory). False when it is not held."""
        ...

    @property
    def num_running(self) -> int: ...


class BatchExecutor:
    """Any :class:`ASRModel`: admitted requests with equal options run as one
    ``model.transcribe`` batch per step, at most ``max_batch_size`` of them (models do not
    re-batch: they run exactly the batch they are given). A failing batch is retried request by
    request so only the bad request fails. The only place in OASR that groups whole requests
    into model calls: the engine's ``transcribe_offline`` / ``transcribe_arrays`` /
    ``transcribe_outputs`` and the server's uploads all come here through the scheduler."""

    def __init__(self, model: ASRModel, max_batch_size: int) -> None:
        self.model = model
        self.max_batch_size = max_batch_size
        self._pending: list[Request] = []

    @property
    def num_running(self) -> int:
        return len(self._pending)

    def try_admit(self, request: Request) -> bool:
        if len(self._pending) >= self.max_batch_size:
            return False
        if self._pending and self._pending[0].options != request.options:
            return False  # one options set per model call
        request.options.validate_for(self.model)
        self._pending.append(request)
        return True

    def abort(self, request: Request) -> bool:
        if request in self._pending:
            self._pending.remove(request)
            return True
        return False

    def step(self) -> list[tuple[Request, Transcript | BaseException]]:
        batch, self._pending = self._pending, []
        if not batch:
            return []
        try:
            return list(zip(batch, self._transcribe(batch), strict=True))
        except Exception as exc:  # noqa: BLE001 - isolate the bad request
            if len(batch) == 1:
                return [(batch[0], exc)]
        done: list[tuple[Request, Transcript | BaseException]] = []
        for r in batch:
            try:
                done.append((r, self._transcribe([r])[0]))
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                done.append((r, exc))
        return done

    def _transcribe(self, batch: list[Request]) -> list[Transcript]:
        watchers = [r.on_progress for r in batch if r.on_progress is not None]

        def progress(done: float, total: float) -> None:
            # the model reports its batch as a whole; every request in it moves together
            share = min(done / total, 1.0) if total > 0 else 1.0
            for watch in watchers:
                watch(share)

        return self.model.transcribe([r.audio for r in batch], batch[0].options,
                                     progress if watchers else None)  # fmt: skip


_by_seq = operator.attrgetter("seq")
_by_bucket = operator.attrgetter("bucket", "seq")


def _settle(future: Future, error: BaseException) -> None:
    """Fail ``future`` unless it is done (another thread may finish it at the same time)."""
    if future.done():
        return
    try:
        future.set_exception(error)
    except InvalidStateError:
        pass


def executor_for(model: ASRModel, config: SchedulerConfig) -> Any:
    """The model's continuous-batching executor when it offers one, else :class:`BatchExecutor`.

    A model opts in with a ``make_executor(config)`` method returning an executor, or None when
    this model/config is not supported (Whisper: ``WhisperASR.make_executor``)."""
    if isinstance(model, SupportsExecutor):
        made = model.make_executor(config)
        if made is not None:
            return made
    return BatchExecutor(model, config.max_batch_size)


class Scheduler:
    """Waiting queue + admission policy + one executor. See the module docstring."""

    def __init__(self, executor: Executor, config: SchedulerConfig | None = None,
                 sample_rate: int = 16000) -> None:  # fmt: skip
        self.executor = executor
        # a continuous executor may hold more requests than it decodes at once (windows encoded
        # ahead of a free row); it says how many through ``max_requests`` (asked once: a
        # runtime Protocol check is too slow for every step)
        self._holds_extra = isinstance(executor, HoldsExtraRequests)
        self.config = config or SchedulerConfig()
        self.sample_rate = sample_rate
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._waiting: list[Request] = []
        self._running: dict[str, Request] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count()
        self.step_count = 0
        self._thread: threading.Thread | None = None
        self._stop = False
        self._step_lock = threading.Lock()
        #: running requests aborted while a step ran: answered at once, freed in the executor
        #: before the next step
        self._aborting: list[Request] = []
        #: most requests waiting for admission seen (introspection / tests)
        self.stats: dict[str, int] = {"max_running": 0, "max_wait_steps_seen": 0}
        #: called after each step, before that step's results reach their callers (so a
        #: caller that got its answer also sees the step in the metrics the hook records)
        self.on_step: Callable[[Scheduler], None] | None = None
        #: requests the last step finished (answered or failed), for ``on_step``
        self.last_step_finished = 0

    # -- submission (any thread) ---------------------------------------------------------------
    def submit(self, audio: np.ndarray, options: DecodingOptions, rid: str | None = None) -> Future:
        return self.submit_many([audio], options, [rid])[0]

    def submit_many(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                    rids: Sequence[str | None] | None = None,
                    on_progress: Callable[[int, float], None] | None = None,
                    on_partial: Callable[[int, str], None] | None = None) -> list[Future]:  # fmt: skip
        """Queue several requests at once: the next step sees all of them, so they are admitted
        as full batches (a step between two single submits would start a batch of one).
        ``on_progress(k, share)`` reports the share of input ``k`` done where the executor can
        tell; ``on_partial(k, text)`` each new piece of input ``k``'s text as it is decoded
        (token-streaming families). All or nothing: beyond ``max_queue`` nothing is queued."""
        with self._lock:
            limit = self.config.max_queue
            if limit is not None and len(self._waiting) + len(audios) > limit:
                raise EngineOverloadedError(
                    f"{len(self._waiting)} requests are already waiting (SchedulerConfig.max_queue="
                    f"{limit}); retry after a short pause"
                )
            futures = []
            for k, audio in enumerate(audios):
                rid = (rids[k] if rids is not None else None) or f"r{next(self._ids)}"
                req = Request(rid, audio, options, next(self._seq), self.step_count)
                req.bucket = self._bucket(req)
                if on_progress is not None:
                    req.on_progress = functools.partial(on_progress, k)
                if on_partial is not None:
                    req.on_partial = functools.partial(on_partial, k)
                req.future.rid = req.rid  # type: ignore[attr-defined]
                self._waiting.append(req)
                futures.append(req.future)
            self._wake.notify_all()
        return futures

    def abort(self, rid: str) -> bool:
        with self._lock:
            for r in self._waiting:
                if r.rid == rid:
                    self._waiting.remove(r)
                    r.future.set_exception(RequestAbortedError(f"request {rid!r} aborted"))
                    return True
        if not self._step_lock.acquire(blocking=False):
            # a step is running (it may be long: a gate or encoder pass over many inputs): the
            # caller is answered now, the executor frees the request before the next step
            with self._lock:
                r = self._running.get(rid)
                if r is None:
                    return False
                self._aborting.append(r)
            _settle(r.future, RequestAbortedError(f"request {rid!r} aborted"))
            return True
        try:  # running requests: between steps only
            with self._lock:
                r = self._running.pop(rid, None)
            if r is None:
                return False
            self.executor.abort(r)
            _settle(r.future, RequestAbortedError(f"request {rid!r} aborted"))
            return True
        finally:
            self._step_lock.release()

    def _free_aborted(self) -> None:
        """Free in the executor the requests aborted during the last step (step lock held)."""
        with self._lock:
            aborting, self._aborting = self._aborting, []
            gone = [r for r in aborting if self._running.pop(r.rid, None) is not None]
        for r in gone:
            try:
                self.executor.abort(r)
            except Exception:  # noqa: BLE001 - an abort never fails the scheduler
                pass

    @property
    def num_waiting(self) -> int:
        with self._lock:
            return len(self._waiting)

    @property
    def num_running(self) -> int:
        with self._lock:
            return len(self._running)

    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    # -- policy --------------------------------------------------------------------------------
    def _bucket(self, r: Request) -> int:
        return int(r.num_samples / (self.config.bucket_seconds * self.sample_rate))

    def _admit(self) -> None:
        capacity = self.executor.max_requests if self._holds_extra else self.config.max_batch_size
        with self._lock:
            if not self._waiting or len(self._running) >= capacity:
                return  # nothing can be admitted: no need to order the queue (1000s long)
            waiting = list(self._waiting)
        now = self.step_count
        bound = self.config.max_wait_steps
        starved = sorted((r for r in waiting if now - r.arrival_step >= bound), key=_by_seq)
        fresh = sorted((r for r in waiting if now - r.arrival_step < bound), key=_by_bucket)
        admitted: list[Request] = []
        failed: list[tuple[Request, BaseException]] = []
        for r in (*starved, *fresh):
            if len(self._running) + len(admitted) >= capacity:
                break
            starving = now - r.arrival_step >= bound
            try:
                ok = self.executor.try_admit(r)
            except Exception as exc:  # noqa: BLE001 - the request fails alone
                failed.append((r, exc))
                continue
            if ok:
                admitted.append(r)
            elif starving:
                break  # hold the room for the oldest starved request: nothing younger goes first
            elif getattr(self.executor, "refuses_all", False):
                break  # the executor refuses any request this step (no room, or a group held)
        with self._lock:
            if admitted or failed:  # one pass over the queue, not a search per request
                gone = {id(r) for r in admitted} | {id(r) for r, _ in failed}
                self._waiting = [r for r in self._waiting if id(r) not in gone]
            for r in admitted:
                r.admitted_step = now
                self._running[r.rid] = r
                self.stats["max_wait_steps_seen"] = max(self.stats["max_wait_steps_seen"], now - r.arrival_step)
            self.stats["max_running"] = max(self.stats["max_running"], len(self._running))
        for r, exc in failed:
            self._finish(r, exc)

    def _finish(self, r: Request, result: Transcript | BaseException) -> None:
        r.finish_time = time.perf_counter()
        r.future.finish_time = r.finish_time  # type: ignore[attr-defined]
        if r.future.done():
            return
        try:
            if isinstance(result, BaseException):
                r.future.set_exception(result)
            else:
                r.future.set_result(result)
        except InvalidStateError:  # aborted by another thread meanwhile
            pass

    # -- stepping (one thread) -----------------------------------------------------------------
    def step(self) -> int:
        """Admit, advance the executor once, resolve finished requests. Returns how many
        requests finished."""
        with self._step_lock:
            self._free_aborted()
            self._admit()
            failed: list[tuple[Request, BaseException]] = []
            try:
                done = self.executor.step()
            except Exception as exc:  # noqa: BLE001 - the executor lost its batch: fail it
                with self._lock:
                    running = list(self._running.values())
                    self._running.clear()
                for r in running:
                    self.executor.abort(r)
                    failed.append((r, exc))
                done = []
            with self._lock:
                for r, _ in done:
                    self._running.pop(r.rid, None)
                self.step_count += 1
            self.last_step_finished = len(done) + len(failed)
            if self.on_step is not None:
                try:
                    self.on_step(self)
                except Exception:  # noqa: BLE001 - a metrics hook never loses an answer
                    log.exception("scheduler on_step hook failed")
            for r, result in [*failed, *done]:
                self._finish(r, result)
            return len(done)

    def run_until_idle(self) -> None:
        while self.has_work():
            self.step()

    def wait_all(self, futures: Sequence[Future]) -> None:
        """Wait for ``futures``: drive the steps here unless the scheduler thread runs."""
        if self._thread is not None and self._thread.is_alive():
            for f in futures:
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001
                    pass
            return
        while not all(f.done() for f in futures):
            self.step()

    def start(self) -> None:
        """Run steps in a daemon thread whenever there is work."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="oasr-scheduler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def _loop(self) -> None:
        settle_torch_threads()
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._running:
                    self._wake.wait()
                if self._stop:
                    return
            self.step()


def settle_torch_threads() -> None:
    """Fix the calling (model) thread's torch intra-op thread count now, from the process
    setting: threads started later (a server's single-threaded VAD pool) may change the default
    that a thread reads on its first parallel op. Every thread that runs a model calls it first
    (the scheduler's, the server's streaming worker)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        try:
            torch.get_num_threads()
        except Exception:  # noqa: BLE001 - only an optimisation
            pass

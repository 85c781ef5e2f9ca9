"""The ASGI application: ``create_app`` wires the engine worker, the routes, auth and metrics.

The event loop only parses requests and writes responses. Audio decoding runs in worker
processes (``decode_processes``, :mod:`oasr.decode_pool`: PyAV holds the GIL while it decodes,
which would starve the engine's scheduler thread), or in a small thread pool (``decode_threads``)
when there are none; the model runs only in the engine worker thread
(:mod:`oasr_server.worker`). Every failure is answered in OpenAI's error shape from the typed
errors in :mod:`oasr.errors` / :mod:`oasr_server.errors`.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hmac
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from oasr.errors import EngineOverloadedError, InvalidRequestError, OASRError
from oasr_server import __version__
from oasr_server.config import ServerConfig
from oasr_server.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    MethodNotAllowedError,
    NotFoundError,
    NotReadyError,
    OriginNotAllowedError,
    RequestTimeoutError,
    UploadTooLargeError,
    error_body,
)
from oasr_server.metrics import ServerMetrics
from oasr_server.worker import EngineWorker, Job

if TYPE_CHECKING:
    import numpy as np

    from oasr.decode_pool import AudioDecodePool
    from oasr.engine import ASREngine
    from oasr.types import DecodingOptions, EngineConfig
    from oasr_server.stream_worker import StreamingEngineLoop

log = logging.getLogger("oasr_server")

#: How often a waiting request checks whether its client is still connected (seconds).
DISCONNECT_POLL_S = 0.5
#: how often, while requests come in, cyclic garbage is collected and freed memory handed back
MEMORY_HOUSEKEEPING_S = 10.0

#: Routes that answer without the API key (probes).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/demo"})  # /demo: a static page, no key


class ServerState:
    """Everything one app instance owns: config, engine, worker, readiness, metrics."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        engine: ASREngine | None = None,
        engine_config: EngineConfig | None = None,
        engine_factory: Callable[[], ASREngine] | None = None,
        on_load_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.config = config
        self.engine = engine
        self.engine_config = engine_config
        self.engine_factory = engine_factory
        self.on_load_failure = on_load_failure
        self.worker: EngineWorker | None = None
        #: streaming service mode: the thread that feeds stream turns to the engine
        self.stream_engine: StreamingEngineLoop | None = None
        self.metrics = ServerMetrics()
        #: after the warm-up, keep every object that exists then out of later garbage
        #: collections (``gc.freeze``; the ``oasr-server`` process sets it: it lives as long as
        #: they do, an in-process app in a larger program may not)
        self.freeze_after_warmup = False
        self.ready = False
        self.load_error: str | None = None
        self.started_at = int(time.time())
        self.decode_limiter = anyio.CapacityLimiter(config.decode_threads)
        #: worker processes that decode uploads (None: decoding runs in threads)
        self.decode_pool: AudioDecodePool | None = None
        self._loader: threading.Thread | None = None
        self._ready_lock = threading.Lock()
        self._ready_listeners: list[Callable[[], None]] = []
        self._closed = False
        #: live streams (realtime WebSockets and gRPC StreamingRecognize), at most max_streams
        self.streams = 0
        #: bumped by every upload, error answer and stream end; memory housekeeping runs only
        #: when it moved
        self.activity = 0
        #: shutting down: /readyz is 503, new realtime sessions and gRPC calls are refused,
        #: committed turns are still answered (``drain``)
        self.draining = False
        #: live realtime sessions (``drain`` waits for their committed turns)
        self.sessions: set[Any] = set()
        #: the gRPC server when --grpc-bind is set
        self.grpc_server: Any = None
        #: request-body bytes being received now (``read_body``), at most max_receiving_bytes
        self.receiving_bytes = 0
        #: seconds of decoded upload audio alive now (``decode``), at most
        #: max_pending_audio_seconds; released when the array is freed
        self.pending_audio_s = 0.0
        self._pending_lock = threading.Lock()
        self._vad: Any = None
        self._vad_lock: asyncio.Lock | None = None
        self._vad_executor: Any = None

    # -- streams and VAD ---------------------------------------------------------------------
    def open_stream(self, api: str) -> None:
        """Take one of the ``max_streams`` slots (raises :class:`TooManyStreamsError`)."""
        from oasr_server.errors import TooManyStreamsError

        if self.streams >= self.config.max_streams:
            raise TooManyStreamsError(
                f"this server already serves {self.config.max_streams} live streams "
                "(--max-streams); retry later or on another instance"
            )
        self.streams += 1
        self.metrics.streams_active.labels(api).inc()

    def close_stream(self, api: str, outcome: str) -> None:
        self.streams -= 1
        self.metrics.streams_active.labels(api).dec()
        self.metrics.streams_total.labels(api, outcome).inc()
        self.activity += 1
        if self.streams == 0:
            release_free_memory()
            # and once more when the stream's last work (VAD, a final transcription) has ended
            try:
                asyncio.get_running_loop().call_later(2.0, release_free_memory)
            except RuntimeError:  # no loop: a synchronous caller
                pass

    async def vad_detector(self) -> Any:
        """The process-wide Silero detector (``oasr.vad.default_detector``), loaded in a thread
        the first time it is needed so the event loop never waits on it."""
        if self._vad is not None:
            return self._vad
        if self._vad_lock is None:
            self._vad_lock = asyncio.Lock()
        async with self._vad_lock:
            if self._vad is None:
                from oasr.errors import MissingPluginError
                from oasr.vad import default_detector

                try:
                    self._vad = await self.run_vad(default_detector)
                except MissingPluginError as exc:
                    from oasr_server.errors import VADUnavailableError

                    raise VADUnavailableError(
                        f"voice activity detection is not available on this server: {exc.message}"
                    ) from None
        return self._vad

    async def run_vad(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run VAD work in the VAD threads (``decode_threads`` of them). Their torch uses one
        intra-op thread: Silero is stepped one 32 ms window at a time, and several OpenMP
        threads per tiny step make it up to 100x slower on a loaded CPU."""
        if self._vad_executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self._vad_executor = ThreadPoolExecutor(
                max_workers=self.config.decode_threads,
                thread_name_prefix="oasr-vad",
                initializer=_one_torch_thread,
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._vad_executor, partial(fn, *args))

    async def drain(self, timeout: float) -> None:
        """The first step of a graceful shutdown (SIGTERM), before the HTTP server stops: every
        surface stops taking new work the same way (``/readyz`` 503, gRPC health NOT_SERVING and
        new calls refused while its calls in flight get ``timeout`` to finish, new realtime
        sessions refused with 1013) and each live realtime session gets its committed turns
        answered (the ``completed`` events sent), at most ``timeout`` seconds. HTTP requests in
        flight are drained by uvicorn afterwards; open sockets are closed with 1012 then."""
        self.draining = True
        self.metrics.ready.set(0)
        grpc_server = self.grpc_server
        if grpc_server is not None:
            await grpc_server.oasr_health.enter_graceful_shutdown()
            self._grpc_stopping = asyncio.ensure_future(grpc_server.stop(grace=timeout))
        deadline = time.monotonic() + timeout
        sessions = list(self.sessions)
        if sessions:
            log.info("shutting down: answering the committed turns of %d realtime session(s)",
                     len(sessions))  # fmt: skip
            await asyncio.gather(*(s.drain(deadline) for s in sessions), return_exceptions=True)

    # -- model loading -----------------------------------------------------------------------
    def start_loading(self) -> None:
        self._loader = threading.Thread(target=self._load, name="oasr-model-loader", daemon=True)
        self._loader.start()

    def _start_decode_pool(self) -> AudioDecodePool | None:
        from oasr.decode_pool import AudioDecodePool, default_decode_processes

        processes = self.config.decode_processes
        if processes is None:
            processes = default_decode_processes()
        if processes == 0:
            return None
        pool = AudioDecodePool(processes)
        try:
            pool.start()
        except Exception:  # noqa: BLE001 - decoding in threads still works, only slower
            log.warning("audio decode processes did not start; decoding in threads", exc_info=True)
            pool.shutdown(wait=False)
            return None
        return pool

    def _load(self) -> None:
        try:
            # a broken plugin is a warning here; the model fails to load only if it needed it
            from oasr.plugins import get_plugin_manager

            for failure in get_plugin_manager().unreported_failures():
                log.warning("%s", failure.message)
            # the decode workers start first: they are plain processes without the model
            self.decode_pool = self._start_decode_pool()
            engine = self.engine
            if engine is None:
                if self.engine_factory is not None:
                    engine = self.engine_factory()
                else:
                    from oasr.engine import ASREngine
                    from oasr.scheduler import SchedulerConfig
                    from oasr.types import EngineConfig

                    engine_config = self.engine_config or EngineConfig()
                    scheduler_config = SchedulerConfig(
                        max_batch_size=engine_config.max_batch_size,
                        gate_seconds_per_step=self.config.gate_seconds_per_step,
                        stream_batch_wait_s=self.config.stream_batch_wait_ms / 1000.0,
                    )
                    engine = ASREngine(engine_config, scheduler_config=scheduler_config)
            self.engine = engine
            if self.config.warmup:
                import numpy as np

                from oasr.types import DecodingOptions

                t0 = time.monotonic()
                engine.transcribe_arrays(
                    [np.zeros(engine.sample_rate, dtype=np.float32)], DecodingOptions()
                )
                log.info("warm-up done in %.2f s", time.monotonic() - t0)
                if getattr(engine, "streaming", None) is not None:
                    self._warm_streams(engine)
                if self.freeze_after_warmup:
                    # what exists now (the model, torch, the libraries: ~300k objects) lives as
                    # long as the server: kept out of every later collection, a full one (the
                    # housekeeping every MEMORY_HOUSEKEEPING_S, or Python's own) no longer stops
                    # the event loop and the stream loop for ~100-200 ms to walk it all
                    gc.collect()
                    gc.freeze()
            worker = EngineWorker(
                engine,
                max_queue=self.config.max_queue,
                max_batch_size=self.config.max_batch_size,
                on_batch=self.metrics.on_batch,
                max_concurrency=self.config.max_concurrency,
            )
            log.info(
                "engine worker: requests go through the engine's scheduler (%s; max %d in the engine)",
                type(engine.scheduler.executor).__name__,
                worker.max_concurrency,
            )
            stream_engine = None
            if getattr(getattr(engine, "config", None), "service_mode", "offline") == "streaming":
                from oasr_server.stream_worker import StreamingEngineLoop

                stream_engine = StreamingEngineLoop(engine, on_batch=self.metrics.on_batch)
                log.info("streams: turns are fed to the engine as audio arrives (feed_chunk/step)")
            with self._ready_lock:
                if self._closed:  # the app shut down while the model was loading
                    pool, self.decode_pool = self.decode_pool, None
                    if pool is not None:
                        pool.shutdown(wait=False)
                    return
                worker.start()
                self.worker = worker
                if stream_engine is not None:
                    stream_engine.start()
                    self.stream_engine = stream_engine
                self.ready = True
                listeners = list(self._ready_listeners)
            self.metrics.bind_worker(lambda: worker.depth, lambda: worker.in_flight)
            # the model's own device where it says (a checkpoint may pick it), else the config's
            from oasr.model import HasDevice

            model = engine.model
            device = (
                model.device
                if isinstance(model, HasDevice)
                else getattr(engine.config, "device", "cpu")
            )
            self.metrics.bind_gpu(str(device))
            if stream_engine is not None:
                self.metrics.bind_engine_streams(lambda: stream_engine.open_streams)
                if getattr(stream_engine.engine, "streaming", None) is not None:
                    self.metrics.bind_stream_cache(stream_engine.engine.streaming.occupancy)
            self.metrics.ready.set(1)
            for listener in listeners:
                listener()
            log.info("model %s ready", engine.model.name)
        except BaseException as exc:  # noqa: BLE001 - reported by /readyz and the CLI
            message = exc.message if isinstance(exc, OASRError) else f"{type(exc).__name__}: {exc}"
            self.load_error = message
            if isinstance(exc, OASRError):
                log.error("model failed to load: %s", message)
            else:
                log.exception("model failed to load: %s", message)
            if self.on_load_failure is not None:
                self.on_load_failure(exc)

    def _warm_streams(self, engine: Any) -> None:
        """Streaming mode, before the server reports ready: the model captures now the CUDA graphs
        of every batch bucket its streaming steps will use (up to ``max_batch_size`` streams, or
        ``max_streams``) and sizes its cache pool for ``max_streams`` streams, from this one
        thread. Captured while serving instead, the first steps of a size would stall, and a
        capture would share the device with uploads running on other threads; growing the pool
        later drops every graph. Models without ``capture_stream_graphs`` (or off CUDA) skip it;
        a failure is a warning (the graphs are then captured as steps need them)."""
        capture = getattr(engine.model, "capture_stream_graphs", None)
        if capture is None:
            return
        streams = max(1, self.config.max_streams)
        batch = max(1, min(int(engine.streaming.max_batch_size), streams))
        t0 = time.monotonic()
        try:
            captured = capture(max_batch=batch, streams=streams)
        except Exception:  # noqa: BLE001 - serving works without graphs captured ahead
            log.warning("streams: CUDA graphs were not captured ahead; steps capture them as "
                        "they need them", exc_info=True)  # fmt: skip
            return
        if captured:
            log.info("streams: %d CUDA graphs captured ahead (up to %d streams per step, cache "
                     "pool for %d streams) in %.2f s", captured, batch, streams,
                     time.monotonic() - t0)  # fmt: skip

    def add_ready_listener(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the loader thread) once the model is ready; at once if it is."""
        with self._ready_lock:
            if not self.ready:
                self._ready_listeners.append(callback)
                return
        callback()

    def wait_loaded(self, timeout: float | None = None) -> bool:
        if self._loader is not None:
            self._loader.join(timeout)
        return self.ready

    def shutdown(self) -> None:
        with self._ready_lock:
            self._closed = True
            worker, self.worker = self.worker, None
            stream_engine, self.stream_engine = self.stream_engine, None
            self.ready = False
        self.metrics.ready.set(0)
        if stream_engine is not None:
            stream_engine.stop()
        if worker is not None:
            worker.stop()
        engine = self.engine
        if engine is not None and hasattr(engine, "shutdown"):
            try:
                engine.shutdown()
            except Exception:  # noqa: BLE001
                log.debug("engine shutdown failed", exc_info=True)
        if self._vad_executor is not None:
            self._vad_executor.shutdown(wait=False, cancel_futures=True)
        pool, self.decode_pool = self.decode_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # -- request helpers ---------------------------------------------------------------------
    def require_ready(self) -> tuple[ASREngine, EngineWorker]:
        worker = self.worker
        if not self.ready or worker is None or self.engine is None:
            if self.load_error:
                raise NotReadyError(f"the model failed to load: {self.load_error}")
            raise NotReadyError("the model is still loading; retry when /readyz answers 200")
        return self.engine, worker

    def retry_after(self) -> int:
        """``Retry-After`` seconds for a busy answer: from the queue (:meth:`EngineWorker.
        retry_after`), at least ``retry_after_s``."""
        floor = self.config.retry_after_s
        worker = self.worker
        return worker.retry_after(floor) if worker is not None else floor

    def metrics_error(self, error: OASRError) -> None:
        self.metrics.errors.labels(error.code).inc()

    def check_model(self, requested: str | None) -> None:
        if not requested:
            return
        names = (self.config.served_model_name, *self.config.model_aliases)
        if requested not in names:
            from oasr.errors import UnknownModelError

            raise UnknownModelError(
                f"model {requested!r} is not served here; this server serves "
                f"{self.config.served_model_name!r} (see GET /v1/models)",
                param="model",
            )

    async def decode(
        self, data: bytes, sample_rate: int, route: str, raw_format: Any = None
    ) -> np.ndarray:
        from oasr.audio import load_audio

        limits = {
            "max_seconds": self.config.max_audio_seconds,
            "raw_format": raw_format,
            "timeout_s": self.config.request_timeout,
        }
        pool = self.decode_pool
        self.activity += 1
        started = time.monotonic()
        outcome = "ok"
        self.metrics.decode_in_flight.inc()
        try:
            if pool is not None:
                audio = await pool.decode(data, sample_rate, **limits)
            else:
                audio = await anyio.to_thread.run_sync(
                    partial(load_audio, data, sample_rate, **limits), limiter=self.decode_limiter
                )
        except OASRError as exc:
            outcome = exc.code
            raise
        except BaseException:
            outcome = "failed"
            raise
        finally:
            self.metrics.decode_in_flight.dec()
            self.metrics.decode_duration.labels(outcome).observe(time.monotonic() - started)
        seconds = audio.shape[-1] / sample_rate
        self._hold(audio, seconds)
        self.metrics.audio_seconds.labels(route).inc(seconds)
        self.metrics.audio_duration.observe(seconds)
        return audio

    def _hold(self, audio: np.ndarray, seconds: float) -> None:
        """Count ``audio`` against ``max_pending_audio_seconds`` until it is freed (a weakref
        finalizer: the route, the queue, the engine and chunked slices all keep the same
        array alive); past the bound it is refused (503) and dropped at once."""
        import weakref

        from oasr_server.errors import AudioBacklogError

        cap = self.config.max_pending_audio_seconds
        with self._pending_lock:
            if self.pending_audio_s > 0 and self.pending_audio_s + seconds > cap:
                raise AudioBacklogError(
                    f"the server holds {self.pending_audio_s:.0f} s of decoded audio already "
                    f"(--max-pending-audio-seconds {cap:g}); retry later"
                )
            self.pending_audio_s += seconds
        weakref.finalize(audio, self._release_audio, seconds)

    def _release_audio(self, seconds: float) -> None:
        with self._pending_lock:
            self.pending_audio_s = max(0.0, self.pending_audio_s - seconds)

    async def transcribe(
        self,
        worker: EngineWorker,
        audio: np.ndarray | list[np.ndarray],
        options: DecodingOptions,
        deadline: float,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
        *,
        multi: bool = False,
    ) -> Any:
        """Queue one request and wait for its result (a :class:`~oasr.types.Transcript`, or a
        list of them with ``multi``), at most until ``deadline``. With ``is_disconnected``, a
        client that went away is noticed (every ``DISCONNECT_POLL_S``) and its work is dropped
        if the engine has not started it. Cancelling the awaiting task drops the work too."""
        options = self.bounded_options(options, audio)
        job: Job = worker.submit(audio, options, multi=multi)
        try:
            await self._wait(job, deadline, is_disconnected, job.future)
            result = job.future.result()
        except asyncio.CancelledError:
            worker.abandon(job)
            raise
        finally:
            if not job.future.done():
                worker.abandon(job)  # timed out or the client went away: skip the work
        self._observe(job)
        return result

    async def transcribe_pieces(
        self,
        worker: EngineWorker,
        audio: np.ndarray,
        options: DecodingOptions,
        deadline: float,
        is_disconnected: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[str | Any]:
        """:meth:`transcribe` with the text as it is decoded: yields each new piece (``str``)
        the model streams (token-streaming families), then the :class:`~oasr.types.Transcript`.
        Families without partials yield the transcript only. Closing the iterator early drops
        the work (the engine aborts it)."""
        loop = asyncio.get_running_loop()
        pieces: list[str] = []
        arrived = asyncio.Event()

        def take(text: str) -> None:
            pieces.append(text)
            arrived.set()

        def on_partial(_k: int, text: str) -> None:  # the scheduler's thread
            try:
                loop.call_soon_threadsafe(take, text)
            except RuntimeError:  # the loop is closed: nobody is listening
                pass

        options = self.bounded_options(options, audio)
        job: Job = worker.submit(audio, options, on_partial=on_partial)
        waiter: asyncio.Future[Any] | None = None
        try:
            while True:
                # pieces are queued on the loop before the result (same thread, in order)
                while pieces:
                    yield pieces.pop(0)
                if job.future.done():
                    break
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                await self._wait(job, deadline, is_disconnected, job.future, waiter)
                waiter.cancel()
            result = job.future.result()
        finally:
            if waiter is not None:
                waiter.cancel()
            if not job.future.done():
                worker.abandon(job)
        self._observe(job)
        yield result

    def bounded_options(
        self, options: DecodingOptions, audio: np.ndarray | list[np.ndarray]
    ) -> DecodingOptions:
        """``options`` with the decoding-work bounds of :class:`ServerConfig`: the temperature
        schedule cut to ``1 + max_fallback_rounds`` temperatures, and the token budget of
        ``max_tokens_per_second`` (only when the client set no ``max_new_tokens``, the audio is
        short enough for the bound to bite, and the model accepts the option)."""
        from dataclasses import replace

        rounds = self.config.max_fallback_rounds
        if rounds is not None and len(options.temperatures) > rounds + 1:
            options = replace(options, temperature=options.temperatures[: rounds + 1])
        rate = self.config.max_tokens_per_second
        engine = self.engine
        if not rate or options.max_new_tokens is not None or engine is None:
            return options
        family = getattr(engine.model.capabilities.decode_family, "value", None)
        if family not in ("aed", "llm"):  # no token budget to bound (CTC, transducer, CIF)
            return options
        from oasr.scheduler import BatchExecutor

        if isinstance(engine.scheduler.executor, BatchExecutor):
            # one options set per model call there: per-request budgets would split batches
            return options
        arrays = audio if isinstance(audio, list) else [audio]
        seconds = max((a.shape[-1] for a in arrays), default=0) / engine.sample_rate
        budget = -(-int(32 + rate * seconds) // 32) * 32  # a multiple of 32: requests still share
        if budget > 224:
            return options
        bounded = replace(options, max_new_tokens=budget)
        try:
            bounded.validate_for(engine.model)
        except OASRError:  # a family without a token budget (CTC, transducer)
            return options
        return bounded

    async def _wait(
        self,
        job: Job,
        deadline: float,
        is_disconnected: Callable[[], Awaitable[bool]] | None,
        *wake: asyncio.Future[Any],
    ) -> None:
        """Wait until one of ``wake`` is done; raise at ``deadline`` or when the client left."""
        while not any(w.done() for w in wake):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RequestTimeoutError(
                    f"the request was not answered within {self.config.request_timeout:g} s "
                    "(--request-timeout); the server is overloaded or the audio is very long"
                )
            await asyncio.wait(
                set(wake), timeout=min(remaining, DISCONNECT_POLL_S),
                return_when=asyncio.FIRST_COMPLETED,
            )  # fmt: skip
            if (
                not any(w.done() for w in wake)
                and is_disconnected is not None
                and await is_disconnected()
            ):
                raise ClientDisconnectedError("the client closed the connection")

    def _observe(self, job: Job) -> None:
        waited = time.monotonic() - job.enqueued_at
        self.metrics.queue_wait.observe(waited)
        if self.engine is not None:
            samples = sum(a.shape[-1] for a in job.inputs)
            self.metrics.on_transcribed(samples / self.engine.sample_rate, waited)


def _one_torch_thread() -> None:
    try:
        import torch
    except ImportError:  # a detector without torch
        return
    # The count is per thread once a thread has used it, but set_num_threads also changes the
    # process default that threads started later pick up: restore that default from a
    # short-lived helper thread, so only the VAD threads run with one.
    default = torch.get_num_threads()
    torch.set_num_threads(1)
    helper = threading.Thread(target=torch.set_num_threads, args=(default,))
    helper.start()
    helper.join()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return None


def release_free_memory() -> None:
    """Hand memory that is free inside the C allocator back to the OS. A stream's audio and the
    VAD's intermediate tensors are freed when it ends, but glibc keeps the pages in its per-thread
    arenas, so without this the server's RSS ratchets up with the largest streams it has seen
    (measured: +300 MB over 170 fuzzed realtime sessions, none of it live objects). Called when
    the last live stream closes; costs about a millisecond."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


async def memory_housekeeping(state: ServerState) -> None:
    """Every :data:`MEMORY_HOUSEKEEPING_S` while requests come in: a full garbage collection,
    then :func:`release_free_memory`. A refused request's exception keeps its traceback, and with
    it the request's body and decoded audio, in a reference cycle until the next full
    collection, which a server answering mostly small requests runs rarely; measured on the fuzz
    run, RSS grew +258 MB over 2000 requests without this and stays flat with it."""
    seen = state.activity
    while True:
        await asyncio.sleep(MEMORY_HOUSEKEEPING_S)
        if state.activity == seen:
            continue
        seen = state.activity
        gc.collect()
        release_free_memory()


async def read_body(request: Request, limit: int, state: ServerState | None = None) -> bytes:
    """The request body, refusing (413) as soon as more than ``limit`` bytes arrive. With
    ``state``: an upload that stalls (``upload_idle_timeout``) or crawls (``upload_min_rate``)
    is 408, and the bytes being received across connections are bounded
    (``max_receiving_bytes``: 503 ``overloaded`` past it, before reading a declared body)."""
    declared = request.headers.get("content-length")
    size = 0
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidRequestError("Content-Length is not a number") from None
        if size > limit:
            raise UploadTooLargeError(
                f"the request body is {size} bytes; this server accepts at most {limit} bytes "
                "(--max-upload-bytes)",
                param="file",
            )
    from starlette.requests import ClientDisconnect

    cfg = state.config if state is not None else None
    idle = cfg.upload_idle_timeout if cfg is not None and cfg.upload_idle_timeout > 0 else None
    min_rate = cfg.upload_min_rate if cfg is not None else 0
    reserved = [0]

    def reserve(n: int) -> None:
        if state is None or n <= reserved[0]:
            return
        more = n - reserved[0]
        if state.receiving_bytes + more > state.config.max_receiving_bytes:
            from oasr_server.errors import UploadsBusyError

            raise UploadsBusyError(
                f"the server is receiving {state.receiving_bytes} bytes of uploads already "
                f"(--max-receiving-bytes {state.config.max_receiving_bytes}); retry later"
            )
        state.receiving_bytes += more
        reserved[0] = n

    buf = bytearray()
    started = time.monotonic()
    try:
        reserve(size)
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), idle)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise _upload_timeout(f"no data for {idle:g} s (--upload-idle-timeout)") from None
            buf += chunk
            if len(buf) > limit:
                raise UploadTooLargeError(
                    f"the request body is larger than {limit} bytes (--max-upload-bytes)",
                    param="file",
                )
            reserve(len(buf))
            took = time.monotonic() - started
            if min_rate and idle and took > idle and len(buf) < min_rate * took:
                raise _upload_timeout(
                    f"{len(buf) / took:.0f} bytes/s, below the {min_rate} bytes/s this server "
                    "accepts (--upload-min-rate)"
                )
    except ClientDisconnect:
        # a client that hangs up mid-upload is not a server error (no traceback, no 500)
        raise ClientDisconnectedError("the client closed the connection mid-upload") from None
    finally:
        if state is not None:
            state.receiving_bytes -= reserved[0]
    return bytes(buf)


def _upload_timeout(why: str) -> OASRError:
    from oasr_server.errors import UploadTimeoutError

    return UploadTimeoutError(f"the upload is too slow: {why}", param="file")


def state_of(request: Request) -> ServerState:
    return request.app.state.oasr


# -- middleware --------------------------------------------------------------------------------


class ObservabilityMiddleware:
    """Bearer-token check (all routes but the probes) and per-route request metrics."""

    def __init__(self, app: ASGIApp, state: ServerState, routes: Callable[[], list[Any]]) -> None:
        self.app = app
        self.state = state
        self.routes = routes

    def _route_label(self, scope: Scope) -> str:
        for route in self.routes():
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return getattr(route, "path", "other")
        for route in self.routes():
            match, _ = route.matches(scope)
            if match == Match.PARTIAL:
                return getattr(route, "path", "other")
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route_label(scope)
        started = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            if scope["path"] not in PUBLIC_PATHS and not origin_allowed(
                scope, self.state.config.allowed_origins
            ):
                err: OASRError = OriginNotAllowedError(
                    "requests from this Origin are not allowed; the server's --allowed-origin "
                    "lists the browser origins it accepts"
                )
                self.state.metrics_error(err)
                await JSONResponse(error_body(err), status_code=403)(scope, receive, send_wrapper)
                return
            key = self.state.config.api_key
            if key is not None and scope["path"] not in PUBLIC_PATHS:
                if not _authorized(scope, key):
                    err = AuthenticationError(
                        "missing or incorrect API key; send it as 'Authorization: Bearer <key>'"
                    )
                    self.state.metrics_error(err)
                    response = JSONResponse(
                        error_body(err), status_code=401, headers={"WWW-Authenticate": "Bearer"}
                    )
                    await response(scope, receive, send_wrapper)
                    return
            await self.app(scope, receive, send_wrapper)
        finally:
            m = self.state.metrics
            m.requests.labels(route, scope.get("method", ""), str(status["code"])).inc()
            m.latency.labels(route).observe(time.perf_counter() - started)


def origin_allowed(scope: Scope, allowed: tuple[str, ...]) -> bool:
    """Whether a request may come from its ``Origin``: none (not a browser), the server's own
    host (same origin), or one of ``allowed`` (``"*"``: any)."""
    origin = host = None
    for name, value in scope.get("headers", []):
        if name == b"origin":
            origin = value.decode("latin-1").strip()
        elif name == b"host":
            host = value.decode("latin-1").strip().lower()
    if origin is None:
        return True
    if "*" in allowed or origin.rstrip("/") in allowed:
        return True
    from urllib.parse import urlsplit

    try:
        netloc = urlsplit(origin).netloc.lower()
    except ValueError:
        return False
    return bool(netloc) and netloc == host


def _authorized(scope: Scope, key: str) -> bool:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            text = value.decode("latin-1")
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(
                token.strip().encode(), key.encode()
            ):
                return True
    return False


# -- app ---------------------------------------------------------------------------------------


def error_response(error: OASRError, state: ServerState | None = None) -> JSONResponse:
    headers = {}
    if isinstance(error, EngineOverloadedError):
        headers["Retry-After"] = str(state.retry_after() if state is not None else 1)
    if state is not None:
        state.activity += 1
        state.metrics_error(error)
    return JSONResponse(error_body(error), status_code=error.http_status, headers=headers)


def create_app(
    config: ServerConfig | None = None,
    *,
    engine: ASREngine | None = None,
    engine_config: EngineConfig | None = None,
    engine_factory: Callable[[], ASREngine] | None = None,
    on_load_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """Build the server. The model loads in a background thread when the app starts (lifespan);
    ``/readyz`` answers 200 once it is loaded and warmed up.

    Give ``engine`` (already built), ``engine_factory`` (called in the loader thread) or
    ``engine_config`` (an :class:`~oasr.engine.ASREngine` is built from it)."""
    config = config or ServerConfig()
    state = ServerState(
        config,
        engine=engine,
        engine_config=engine_config,
        engine_factory=engine_factory,
        on_load_failure=on_load_failure,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        grpc_server = None
        if config.grpc_bind:
            from oasr_server.grpc_api.service import start_grpc_server

            grpc_server = await start_grpc_server(state, config.grpc_bind)
        app.state.grpc_server = grpc_server
        state.grpc_server = grpc_server
        state.start_loading()
        housekeeping = asyncio.get_running_loop().create_task(memory_housekeeping(state))
        try:
            yield
        finally:
            housekeeping.cancel()
            if grpc_server is not None:
                await grpc_server.oasr_health.enter_graceful_shutdown()
                await grpc_server.stop(grace=min(10.0, config.request_timeout))
            await anyio.to_thread.run_sync(state.shutdown)

    app = FastAPI(
        title="OASR server",
        version=__version__,
        description="OpenAI-compatible speech recognition over one in-process OASR engine.",
        lifespan=lifespan,
    )
    app.state.oasr = state

    @app.exception_handler(OASRError)
    async def _oasr_error(request: Request, exc: OASRError) -> JSONResponse:
        if isinstance(exc, ClientDisconnectedError):  # one line, no traceback (counted 499)
            log.info("%s %s: %s (499)", request.method, request.url.path, exc.message)
        return error_response(exc, state)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err: OASRError = NotFoundError(f"no route {request.method} {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowedError(f"{request.method} is not allowed on {request.url.path}")
        else:
            err = InvalidRequestError(str(exc.detail))
            err.http_status = exc.status_code
        return error_response(err, state)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x not in ("body", "query")]
        err = InvalidRequestError(
            f"{'.'.join(loc) or 'request'}: {first.get('msg', 'invalid value')}",
            param=loc[-1] if loc else None,
        )
        return error_response(err, state)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        err = OASRError("internal server error; the failure is in the server log")
        return error_response(err, state)

    from oasr_server import routes

    routes.add_routes(app, state)
    if config.demo:
        from oasr_server.demo import add_demo_routes

        add_demo_routes(app)
    app.add_middleware(ObservabilityMiddleware, state=state, routes=lambda: app.router.routes)
    if config.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware

        # outermost: a preflight is answered before the API-key check (browsers send none)
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(config.allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "OpenAI-Beta"],
            expose_headers=["Retry-After"],
            max_age=600,
        )
    return app

"""``ASREngine``: one loaded model behind a small, thread-safe API, pinned to a service mode.

Offline mode (``EngineConfig(service_mode="offline")``):

* :meth:`ASREngine.submit` ``(audio, options) -> Future[Transcript]`` from any thread; a scheduler
  thread batches the requests of all callers (:mod:`oasr.scheduler`: length bucketing, memory-
  bounded admission, a starvation bound, per-request errors, and continuous batching of the
  decoder for models whose plugin provides an executor, Whisper included);
* :meth:`ASREngine.transcribe_outputs` ``(inputs, decoding=...)``: many inputs through the
  scheduler, one :class:`RequestOutput` each (a failed input carries its error, the others their
  transcripts);
* :meth:`transcribe_offline` / :meth:`transcribe_arrays`: the direct per-batch path (sorted by
  length, batches of ``max_batch_size``, one ``model.transcribe`` call each), unchanged.

Streaming mode (``service_mode="streaming"``, models with ``capabilities.streaming``): the
:class:`oasr.streaming.StreamingScheduler` behind :meth:`add_streaming_request`,
:meth:`feed_chunk`, :meth:`step`, :meth:`run` and :meth:`abort`.

Calling a method of the other mode raises :class:`ServiceModeError` (a typed 400 error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Union

from oasr.errors import AudioTooLongError, UnsupportedOptionError
from oasr.scheduler import (
    BatchExecutor,
    RequestAbortedError,
    Scheduler,
    SchedulerConfig,
    executor_for,
)
from oasr.types import DecodingOptions, EngineConfig, Transcript

if TYPE_CHECKING:
    import numpy as np

    from oasr.model import ASRModel, ProgressCallback

AudioInput = Union[str, Path, bytes, BinaryIO, "np.ndarray"]


__all__ = ["ASREngine", "RequestOutput", "ServiceModeError", "StreamOutput", "RequestAbortedError"]


def _local_input(source: Any) -> bool:
    """Inputs decoded in the caller even with decode processes: arrays (nothing to decode) and
    file objects (they cannot travel to another process)."""
    return not isinstance(source, (str, Path, bytes, bytearray, memoryview))


class ServiceModeError(UnsupportedOptionError):
    """A method of the other service mode was called (streaming API on an offline engine, or the
    offline API on a streaming engine)."""

    code = "wrong_service_mode"


@dataclass
class RequestOutput:
    """The outcome of one offline request: its transcript, or the error it alone failed with."""

    request_id: str
    transcript: Transcript | None
    error: BaseException | None = None
    latency_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class StreamOutput:
    """One streaming update: the hypothesis so far (partial) or the final result."""

    request_id: str
    text: str
    is_final: bool
    transcript: Transcript | None = None


class ASREngine:
    def __init__(self, config: EngineConfig, model: ASRModel | None = None, *,
                 scheduler_config: SchedulerConfig | None = None) -> None:  # fmt: skip
        from oasr.checkpoint import load_model

        self.config = config
        if config.num_threads:
            import torch

            torch.set_num_threads(config.num_threads)
        self.model: ASRModel = model if model is not None else load_model(config)
        caps = self.model.capabilities
        if config.service_mode == "streaming" and not caps.streaming:
            raise UnsupportedOptionError(
                f"{self.model.name} cannot stream; start the engine with service_mode='offline'",
                param="service_mode",
            )
        self._lock = threading.Lock()
        #: worker processes for decoding many inputs (EngineConfig.decode_processes), on first use
        self._decode_pool: Any = None
        self._pool_lock = threading.Lock()
        self.scheduler: Scheduler | None = None
        self.streaming = None
        if config.service_mode == "offline":
            sc = scheduler_config or SchedulerConfig(max_batch_size=config.max_batch_size)
            self.scheduler_config = sc
            self._sched_lock = threading.Lock()
        else:
            from oasr.streaming import StreamingScheduler

            self.streaming = StreamingScheduler(self.model, max_batch_size=config.max_batch_size)  # type: ignore[arg-type]

    # -- mode checks -----------------------------------------------------------------------------
    def _offline(self, what: str) -> Scheduler:
        if self.config.service_mode != "offline":
            raise ServiceModeError(
                f"{what} is offline-mode API; this engine runs service_mode='streaming'",
                param="service_mode",
            )
        if self.scheduler is None:
            with self._sched_lock:
                if self.scheduler is None:
                    executor = executor_for(self.model, self.scheduler_config)
                    self.scheduler = Scheduler(executor, self.scheduler_config, self.sample_rate)
        return self.scheduler

    def _streaming(self, what: str):  # noqa: ANN202
        if self.streaming is None:
            raise ServiceModeError(
                f"{what} is streaming-mode API; this engine runs service_mode='offline' "
                f"(start it with EngineConfig(service_mode='streaming'))",
                param="service_mode",
            )
        return self.streaming

    # -- offline: the scheduler ------------------------------------------------------------------
    def submit(self, audio: AudioInput, options: DecodingOptions | None = None,
               request_id: str | None = None) -> Future:  # fmt: skip
        """Queue one input (path, bytes, file object or 1-D float array) from any thread; the
        returned future resolves to its :class:`Transcript` (or raises its error). ``future.rid``
        is the request id (for :meth:`abort`). Starts the scheduler thread on first use."""
        sched = self._offline("submit")
        options = options or DecodingOptions()
        options.check_supported(self.model.capabilities, self.model.name)
        wave = self.load_audio(audio)
        fut = sched.submit(wave, options, request_id)
        sched.start()
        return fut

    def transcribe_outputs(
        self,
        inputs: Sequence[AudioInput],
        streaming: bool = False,
        decoding: DecodingOptions | None = None,
    ) -> list[RequestOutput]:
        """Transcribe many inputs together, one :class:`RequestOutput` per input in order; an
        input that fails (unreadable audio, options its model refuses) fails alone.
        ``streaming=True`` (streaming engines only) feeds each input through the streaming path."""
        options = decoding or DecodingOptions()
        if streaming:
            return self._transcribe_streaming(inputs, options)
        sched = self._offline("transcribe_outputs")
        t0 = time.perf_counter()
        futures: list[Future | BaseException] = []
        for audio in self.load_audios(inputs):
            try:
                if isinstance(audio, BaseException):
                    raise audio
                options.check_supported(self.model.capabilities, self.model.name)
                futures.append(sched.submit(audio, options))
            except Exception as exc:  # noqa: BLE001 - this input fails alone
                futures.append(exc)
        sched.wait_all([f for f in futures if isinstance(f, Future)])
        out: list[RequestOutput] = []
        for k, f in enumerate(futures):
            if isinstance(f, BaseException):
                out.append(RequestOutput(str(k), None, f))
                continue
            rid = getattr(f, "rid", str(k))
            exc = f.exception()
            lat = getattr(f, "finish_time", time.perf_counter()) - t0
            out.append(RequestOutput(rid, None if exc else f.result(), exc, lat))
        return out

    def _transcribe_streaming(self, inputs: Sequence[AudioInput], options: DecodingOptions) -> list[RequestOutput]:
        sched = self._streaming("transcribe_outputs(streaming=True)")
        rids = []
        for x in inputs:
            rid = sched.add_request(options)
            sched.feed_chunk(rid, self.load_audio(x), is_last=True)
            rids.append(rid)
        finals = sched.run()
        out = []
        for rid in rids:
            t = finals.get(rid) or sched.result(rid)
            sched.release(rid)
            out.append(RequestOutput(rid, t, None if t is not None else RequestAbortedError(f"{rid} did not finish")))
        return out

    def shutdown(self) -> None:
        """Stop the scheduler thread (queued requests stay queued) and the decode processes."""
        if self.scheduler is not None:
            self.scheduler.stop()
        pool, self._decode_pool = self._decode_pool, None
        if pool is not None:
            pool.shutdown()

    # -- streaming ---------------------------------------------------------------------------------
    def add_streaming_request(self, options: DecodingOptions | None = None,
                              request_id: str | None = None) -> str:  # fmt: skip
        """Open a stream; returns its id."""
        return self._streaming("add_streaming_request").add_request(options, request_id)

    def feed_chunk(self, rid: str, chunk, is_last: bool = False) -> None:  # noqa: ANN001
        """Append mono float32 samples at the model's rate to stream ``rid``."""
        self._streaming("feed_chunk").feed_chunk(rid, chunk, is_last)

    def step(self) -> list[StreamOutput]:
        """One batched step over the ready streams: partial and final outputs."""
        updates = self._streaming("step").step()
        return [StreamOutput(rid, u.text, u.is_final, u.transcript) for rid, u in updates]

    def run(self) -> dict[str, Transcript | None]:
        """Step until no stream can advance; the final transcripts of the streams that ended."""
        return self._streaming("run").run()

    def abort(self, rid: str) -> bool:
        """Drop a stream (streaming mode) or a queued/running request (offline mode)."""
        if self.streaming is not None:
            return self.streaming.abort(rid)
        return self._offline("abort").abort(rid)

    @property
    def sample_rate(self) -> int:
        return self.model.feature_spec.sample_rate

    def load_audio(self, source: AudioInput) -> np.ndarray:
        """Decode and resample one input to the model's rate; enforce the duration limit."""
        import numpy as np

        if isinstance(source, np.ndarray):
            audio = np.ascontiguousarray(source, dtype=np.float32)
        else:
            from oasr.audio import load_audio

            audio = load_audio(
                source, self.sample_rate, max_seconds=self.config.max_audio_seconds
            )
        seconds = audio.shape[-1] / self.sample_rate
        if seconds > self.config.max_audio_seconds:
            raise AudioTooLongError(
                f"audio is {seconds:.1f} s long; this engine accepts at most "
                f"{self.config.max_audio_seconds:.0f} s (EngineConfig.max_audio_seconds)"
            )
        return audio

    def load_audios(self, sources: Sequence[AudioInput]) -> list[np.ndarray | BaseException]:
        """:meth:`load_audio` for many inputs, in order; an input that cannot be decoded gives
        its error in its place. With ``EngineConfig.decode_processes`` the files and bytes are
        decoded in that many worker processes at once (PyAV holds the GIL while it decodes, so
        threads would not run in parallel); file objects and arrays are read here."""
        pending: dict[int, Any] = {}
        pool = self._pool_for(sum(not _local_input(x) for x in sources))
        if pool is not None:
            for i, x in enumerate(sources):
                if not _local_input(x):
                    pending[i] = pool.submit(
                        x, self.sample_rate, max_seconds=self.config.max_audio_seconds
                    )
        out: list[np.ndarray | BaseException] = []
        for i, x in enumerate(sources):
            try:
                audio = pending[i].result() if i in pending else x
                out.append(self.load_audio(audio))  # arrays: the length check only
            except Exception as exc:  # noqa: BLE001 - this input fails alone
                out.append(exc)
        return out

    def _pool_for(self, files: int) -> Any:
        """The decode pool when it is configured and there is more than one file to decode."""
        if self.config.decode_processes < 1 or files < 2:
            return None
        with self._pool_lock:
            if self._decode_pool is None:
                from oasr.decode_pool import AudioDecodePool

                self._decode_pool = AudioDecodePool(self.config.decode_processes)
        return self._decode_pool

    def transcribe_offline(
        self,
        inputs: AudioInput | Sequence[AudioInput],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Transcribe one or several inputs (paths, bytes, file objects or 1-D float arrays).
        Returns one :class:`Transcript` per input, in input order."""
        if isinstance(inputs, (str, Path, bytes)) or hasattr(inputs, "read") or (
            hasattr(inputs, "ndim") and getattr(inputs, "ndim", 0) == 1
        ):
            inputs = [inputs]  # type: ignore[list-item]
        audios = self.load_audios(list(inputs))  # type: ignore[arg-type]
        for audio in audios:
            if isinstance(audio, BaseException):
                raise audio
        return self.transcribe_arrays(audios, decoding, progress)  # type: ignore[arg-type]

    def transcribe_arrays(
        self,
        audios: Sequence[np.ndarray],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        options = decoding or DecodingOptions()
        options.check_supported(self.model.capabilities, self.model.name)
        total = float(sum(a.shape[-1] for a in audios)) / self.sample_rate
        if self._continuous_on_gpu():
            return self._transcribe_scheduled(audios, options, total, progress)
        order = sorted(range(len(audios)), key=lambda i: audios[i].shape[-1])
        done = 0.0
        results: list[Transcript | None] = [None] * len(audios)
        batch = self.config.max_batch_size
        with self._lock:
            for start in range(0, len(order), batch):
                idx = order[start : start + batch]
                batch_seconds = sum(audios[i].shape[-1] for i in idx) / self.sample_rate
                base = done

                def batch_progress(d: float, t: float, base: float = base, span: float = batch_seconds) -> None:
                    if progress is not None and t > 0:
                        progress(base + span * min(d / t, 1.0), total)

                outs = self.model.transcribe([audios[i] for i in idx], options, batch_progress)
                for i, out in zip(idx, outs, strict=True):
                    results[i] = out
                done += batch_seconds
                if progress is not None:
                    progress(done, total)
        return [r for r in results if r is not None]

    def _continuous_on_gpu(self) -> bool:
        """Whether offline batches go through the scheduler: on a GPU with a continuous-batching
        executor (CUDA graphs, rows refilled as windows finish), that path is several times
        faster than whole batches. On the CPU the per-batch path is kept (measured the faster)."""
        # the model's device first: building the executor reserves its KV-cache pools, which a
        # CPU engine that never submits must not pay for
        from oasr.model import SupportsExecutor, model_device

        on_gpu = model_device(self.model).startswith("cuda")
        if not on_gpu or self.config.service_mode != "offline" or not isinstance(self.model, SupportsExecutor):
            return False
        return not isinstance(self._offline("transcribe").executor, BatchExecutor)

    def _transcribe_scheduled(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                              total: float, progress: ProgressCallback | None) -> list[Transcript]:  # fmt: skip
        sched = self._offline("transcribe")
        futures = [sched.submit(a, options) for a in audios]
        sched.start()
        if progress is not None:  # progress by finished inputs
            seconds = {f: a.shape[-1] / self.sample_rate for f, a in zip(futures, audios, strict=True)}
            done = 0.0
            for fut in as_completed(futures):
                done += seconds[fut]
                progress(done, total)
        return [fut.result() for fut in futures]

"""``ASREngine``: one loaded model behind a small, thread-safe API, pinned to a service mode.

Every whole-utterance request goes through one request scheduler (:attr:`ASREngine.scheduler`,
:mod:`oasr.scheduler`): length bucketing, memory-bounded admission, a starvation bound,
per-request errors, and one executor that groups requests into model calls (the model's
continuous-batching executor where its plugin offers one, Whisper included; else
:class:`~oasr.scheduler.BatchExecutor`, one ``model.transcribe`` call per admitted batch of at most
``max_batch_size``). Nothing else batches requests: models run exactly the batch they are given.

* :meth:`ASREngine.transcribe_offline` ``(inputs)``: one input (a path, bytes, a file object or a
  1-D float array) gives one :class:`Transcript`, a list gives a list in input order;
* :meth:`ASREngine.transcribe_arrays`: the same for decoded arrays (always a list);
* :meth:`ASREngine.submit` ``(audio, options) -> Future[Transcript]`` from any thread (the
  server's path); :meth:`abort` drops a request;
* :meth:`ASREngine.transcribe_outputs`: many inputs, one :class:`RequestOutput` each (a failed
  input carries its error, the others their transcripts).

These work in both service modes (a streaming engine runs whole utterances through its model's
offline ``transcribe``). Streaming mode (``service_mode="streaming"``, models with
``capabilities.streaming``) adds the :class:`oasr.streaming.StreamingScheduler` behind
:meth:`add_streaming_request`, :meth:`feed_chunk`, :meth:`step`, :meth:`run` and :meth:`abort`;
:meth:`transcribe` feeds whole inputs through it chunk by chunk. On an offline engine
:meth:`transcribe` is :meth:`transcribe_offline`.

Calling streaming API on an offline engine raises :class:`ServiceModeError` (a typed 400 error).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Union, overload

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


__all__ = [
    "ASREngine",
    "DecodingOptions",
    "EngineConfig",
    "RequestAbortedError",
    "RequestOutput",
    "ServiceModeError",
    "StreamOutput",
    "Transcript",
]


def _local_input(source: Any) -> bool:
    """Inputs decoded in the caller even with decode processes: arrays (nothing to decode) and
    file objects (they cannot travel to another process)."""
    return not isinstance(source, (str, Path, bytes, bytearray, memoryview))


def _is_single(inputs: Any) -> bool:
    """One input (a path, bytes, a file object or a 1-D array), as opposed to a list of them."""
    if isinstance(inputs, (str, Path, bytes, bytearray, memoryview)) or hasattr(inputs, "read"):
        return True
    return getattr(inputs, "ndim", None) == 1


class ServiceModeError(UnsupportedOptionError):
    """A streaming-mode method was called on an offline engine."""

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
    #: the text added since the previous update (:meth:`ASREngine.transcribe_partials`)
    delta: str = ""


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
        #: worker processes for decoding many inputs (EngineConfig.decode_processes), on first use
        self._decode_pool: Any = None
        self._pool_lock = threading.Lock()
        self.scheduler_config = scheduler_config or SchedulerConfig(max_batch_size=config.max_batch_size)
        if config.kv_cache_dtype is not None and self.scheduler_config.kv_cache_dtype is None:
            import dataclasses

            self.scheduler_config = dataclasses.replace(self.scheduler_config, kv_cache_dtype=config.kv_cache_dtype)
        self._scheduler: Scheduler | None = None
        self._sched_lock = threading.Lock()
        self.streaming = None
        if config.service_mode == "streaming":
            from oasr.streaming import StreamingScheduler

            self.streaming = StreamingScheduler(self.model, max_batch_size=config.max_batch_size,  # type: ignore[arg-type]
                                                max_batch_wait_s=self.scheduler_config.stream_batch_wait_s)

    # -- the request scheduler -------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        """The scheduler every whole-utterance request goes through, built on first use (a
        continuous executor reserves its KV-cache pools then). Its ``num_waiting`` /
        ``num_running`` and ``on_step`` hook are public (the server's metrics read them)."""
        if self._scheduler is None:
            with self._sched_lock:
                if self._scheduler is None:
                    executor = executor_for(self.model, self.scheduler_config)
                    self._scheduler = Scheduler(executor, self.scheduler_config, self.sample_rate)
        return self._scheduler

    def _streaming(self, what: str):  # noqa: ANN202
        if self.streaming is None:
            raise ServiceModeError(
                f"{what} is streaming-mode API; this engine runs service_mode='offline' "
                f"(start it with EngineConfig(service_mode='streaming'))",
                param="service_mode",
            )
        return self.streaming

    def submit(self, audio: AudioInput, options: DecodingOptions | None = None,
               request_id: str | None = None) -> Future:  # fmt: skip
        """Queue one input (path, bytes, file object or 1-D float array) from any thread; the
        returned future resolves to its :class:`Transcript` (or raises its error). ``future.rid``
        is the request id (for :meth:`abort`). Starts the scheduler thread on first use. A full
        queue (``SchedulerConfig.max_queue``) raises :class:`~oasr.errors.EngineOverloadedError`."""
        return self.submit_many([audio], options, [request_id])[0]

    def submit_many(self, audios: Sequence[AudioInput], options: DecodingOptions | None = None,
                    request_ids: Sequence[str | None] | None = None,
                    on_partial: Callable[[int, str], None] | None = None) -> list[Future]:  # fmt: skip
        """:meth:`submit` for several inputs at once: they reach the scheduler together, so they
        can share a batch (the server's chunked uploads). The options are checked and every input
        decoded before anything is queued: an error here queues nothing. ``on_partial(k, text)``
        receives each new piece of input ``k``'s text as it is decoded, in the scheduler's thread
        (token-streaming families; see :meth:`transcribe_partials`)."""
        sched = self.scheduler
        # refused before any work; the requests carry the family options resolved
        options = (options or DecodingOptions()).validate_for(self.model)
        waves = [self.load_audio(a) for a in audios]
        futures = sched.submit_many(waves, options, request_ids, on_partial=on_partial)
        sched.start()
        return futures

    def transcribe_partials(self, audio: AudioInput, options: DecodingOptions | None = None,
                            request_id: str | None = None) -> Iterator[StreamOutput]:  # fmt: skip
        """Offline recognition of one input with its text as it is decoded (token-streaming
        partials): :class:`StreamOutput` updates with ``delta`` (the new text) and ``text`` (all
        of it so far), then one ``is_final`` update with the :class:`Transcript`. Families that
        cannot stream tokens (every family but the speech-LLM today) give the final update only.
        Stopping the iteration early aborts the request."""
        updates: queue.Queue[str | None] = queue.Queue()
        (future,) = self.submit_many([audio], options, [request_id],
                                     on_partial=lambda _k, text: updates.put(text))  # fmt: skip
        future.add_done_callback(lambda _f: updates.put(None))
        rid = getattr(future, "rid", request_id or "")
        text = ""
        try:
            while (delta := updates.get()) is not None:
                text += delta
                yield StreamOutput(rid, text, False, delta=delta)
        finally:
            if not future.done():
                self.abort(rid)
        transcript = future.result()
        yield StreamOutput(rid, transcript.text, True, transcript)

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
        t0 = time.perf_counter()
        futures = self._stream_requests(inputs, options)
        if futures is None:
            futures = self._run_requests(self.load_audios(inputs), options)
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

    def _run_requests(self, audios: Sequence[np.ndarray | BaseException], options: DecodingOptions,
                      progress: ProgressCallback | None = None) -> list[Future | BaseException]:  # fmt: skip
        """Run ``audios`` through the scheduler and wait: a Future (done) per input, in order, or
        the input's own error. The inputs are queued shortest first in one call, so the first
        step sees them all and admits full batches of similar lengths (what the former direct
        per-batch path did by hand); the caller's thread drives the steps unless the scheduler
        thread runs (continuous executors always run in that thread, as ``submit`` does)."""
        try:
            options = options.validate_for(self.model)
        except Exception as exc:  # noqa: BLE001 - every input fails with it
            return [exc for _ in audios]
        todo = sorted((k for k, a in enumerate(audios) if not isinstance(a, BaseException)),
                      key=lambda k: audios[k].shape[-1])  # type: ignore[union-attr]  # fmt: skip
        sched = self.scheduler
        report = None if progress is None else self._progress_reporter(audios, todo, progress)
        futures = sched.submit_many([audios[k] for k in todo], options,  # type: ignore[misc]
                                    on_progress=report)  # fmt: skip
        if report is not None:
            for j, fut in enumerate(futures):
                fut.add_done_callback(lambda _f, j=j: report(j, 1.0))
        if not isinstance(sched.executor, BatchExecutor):
            sched.start()
        sched.wait_all(futures)
        out: list[Future | BaseException] = list(audios)  # type: ignore[arg-type]
        for k, fut in zip(todo, futures, strict=True):
            out[k] = fut
        return out

    def _stream_requests(self, sources: Sequence[AudioInput],
                         options: DecodingOptions) -> list[Future | BaseException] | None:  # fmt: skip
        """Decode ``sources`` in the decode pool and queue each input into the scheduler as its
        samples arrive (the inputs decoded by then together, shortest first), so the model
        starts on the first files while the pool decodes the rest; then wait. A Future (done) per
        input, in order, or the input's own decoding error. None where this does not apply (no
        pool, or the batch executor, whose batches stay the sorted whole list of
        :meth:`_run_requests`; options the model refuses: that path reports them)."""
        pool = self._pool_for(sum(not _local_input(x) for x in sources))
        if pool is None or isinstance(self.scheduler.executor, BatchExecutor):
            return None
        try:
            options = options.validate_for(self.model)
        except Exception:  # noqa: BLE001 - _run_requests answers every input with it
            return None
        sched = self.scheduler
        arrived: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        limit = self.config.max_audio_seconds
        for i, x in enumerate(sources):
            if not _local_input(x):
                pool.submit(x, self.sample_rate, max_seconds=limit).add_done_callback(
                    lambda f, i=i: arrived.put((i, f))
                )
        out: list[Future | BaseException | None] = [None] * len(sources)
        for i, x in enumerate(sources):
            if _local_input(x):  # file objects and arrays, here, while the pool decodes
                arrived.put((i, x))
        sched.start()
        left = len(sources)
        while left:
            batch = [arrived.get()]
            while True:  # everything decoded by now goes in together
                try:
                    batch.append(arrived.get_nowait())
                except queue.Empty:
                    break
            left -= len(batch)
            ready: list[tuple[int, np.ndarray]] = []
            for i, item in batch:
                try:
                    audio = item.result() if isinstance(item, Future) else item
                    ready.append((i, self.load_audio(audio)))  # arrays: the length check only
                except Exception as exc:  # noqa: BLE001 - this input fails alone
                    out[i] = exc
            ready.sort(key=lambda r: r[1].shape[-1])
            try:
                futures = sched.submit_many([a for _, a in ready], options)
            except Exception as exc:  # noqa: BLE001 - a full queue: these inputs fail with it
                futures = [exc] * len(ready)  # type: ignore[list-item]
            for (i, _), fut in zip(ready, futures, strict=True):
                out[i] = fut
        sched.wait_all([f for f in out if isinstance(f, Future)])
        return out  # type: ignore[return-value]

    def _progress_reporter(self, audios: Sequence[Any], todo: list[int], progress: ProgressCallback) -> Any:
        """``report(j, share)`` for the j-th queued input -> ``progress(seconds done, total)``:
        per finished input, and within a batch where the executor reports the model's progress."""
        seconds = [audios[k].shape[-1] / self.sample_rate for k in todo]
        total = float(sum(seconds))
        shares = [0.0] * len(todo)
        lock = threading.Lock()
        last = [-1.0]

        def report(j: int, share: float) -> None:
            with lock:
                shares[j] = max(shares[j], share)
                done = sum(s * sec for s, sec in zip(shares, seconds, strict=True))
                if done <= last[0]:
                    return
                last[0] = done
            progress(done, total)

        return report

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
        if self._scheduler is not None:
            self._scheduler.stop()
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
        """Drop a stream (streaming mode) or a queued/running whole-utterance request."""
        if self.streaming is not None and self.streaming.abort(rid):
            return True
        return self._scheduler is not None and self._scheduler.abort(rid)

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
                # every worker starts now, beside the first decodes (not one more per call)
                self._decode_pool.start(wait=False)
        return self._decode_pool

    @overload
    def transcribe_offline(self, inputs: str | Path | bytes | BinaryIO, decoding: DecodingOptions | None = None,
                           progress: ProgressCallback | None = None) -> Transcript: ...  # fmt: skip
    @overload
    def transcribe_offline(self, inputs: Sequence[AudioInput], decoding: DecodingOptions | None = None,
                           progress: ProgressCallback | None = None) -> list[Transcript]: ...  # fmt: skip

    def transcribe_offline(
        self,
        inputs: AudioInput | Sequence[AudioInput],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> Transcript | list[Transcript]:
        """Transcribe whole inputs (paths, bytes, file objects or 1-D float arrays) through the
        scheduler. One input gives one :class:`Transcript`; a list gives a list, in input order.
        ``progress(seconds_done, seconds_total)`` is called as the work advances. The first
        input that fails raises its error (:meth:`transcribe_outputs` keeps the others)."""
        single = _is_single(inputs)
        items = [inputs] if single else list(inputs)  # type: ignore[arg-type]
        streamed = None if progress is not None else self._stream_requests(items, decoding or DecodingOptions())  # type: ignore[arg-type]
        if streamed is not None:
            # the serial path's errors: the first input that did not decode, else the first
            # that failed in the model
            for r in streamed:
                if isinstance(r, BaseException):
                    raise r
            texts = [r.result() for r in streamed]  # type: ignore[union-attr]
            return texts[0] if single else texts
        audios = self.load_audios(items)  # type: ignore[arg-type]
        for audio in audios:
            if isinstance(audio, BaseException):
                raise audio
        out = self.transcribe_arrays(audios, decoding, progress)  # type: ignore[arg-type]
        return out[0] if single else out

    def transcribe_arrays(
        self,
        audios: Sequence[np.ndarray],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Decoded mono float32 arrays at the model's rate -> one :class:`Transcript` each, in
        order, through the scheduler (see :meth:`transcribe_offline`)."""
        results = self._run_requests(list(audios), decoding or DecodingOptions(), progress)
        out: list[Transcript] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            out.append(r.result())
        return out

    def transcribe(
        self,
        inputs: AudioInput | Sequence[AudioInput],
        decoding: DecodingOptions | None = None,
        progress: ProgressCallback | None = None,
    ) -> Transcript | list[Transcript]:
        """Transcribe whole inputs the way this engine serves: on a streaming engine each input
        is attached as one stream and fed chunk by chunk through the streaming scheduler
        (concurrent streams batched per step; the answer equals a live stream's); on an offline
        engine this is :meth:`transcribe_offline`. One input gives one :class:`Transcript`, a
        list gives a list in input order; a failed input raises its error."""
        if self.streaming is None:
            return self.transcribe_offline(inputs, decoding, progress)
        single = _is_single(inputs)
        items = [inputs] if single else list(inputs)  # type: ignore[arg-type]
        outs = self._transcribe_streaming(items, decoding or DecodingOptions())  # type: ignore[arg-type]
        for o in outs:
            if o.error is not None:
                raise o.error
        if progress is not None:  # streams finish together: report the whole at the end
            total = sum(o.transcript.duration for o in outs if o.transcript is not None)
            progress(total, total)
        transcripts = [o.transcript for o in outs]
        return transcripts[0] if single else transcripts  # type: ignore[return-value]

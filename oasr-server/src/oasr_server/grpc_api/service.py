"""``oasr.speech.v1.Speech/Recognize`` on a ``grpc.aio`` server that shares the HTTP server's
event loop, engine worker, limits and metrics."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from oasr.errors import EngineOverloadedError, InvalidRequestError, OASRError
from oasr_server.errors import AuthenticationError, EngineFailureError, UploadTooLargeError
from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc

if TYPE_CHECKING:
    from oasr_server.app import ServerState

log = logging.getLogger("oasr_server.grpc")

SERVICE = speech_pb2.DESCRIPTOR.services_by_name["Speech"].full_name  # oasr.speech.v1.Speech
METHOD = f"/{SERVICE}/Recognize"
STREAM_METHOD = f"/{SERVICE}/StreamingRecognize"
_DONE = object()

STATUS_FOR_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    500: grpc.StatusCode.INTERNAL,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}

_ENCODINGS = {
    speech_pb2.PCM_S16LE: "pcm_s16le",
    speech_pb2.PCM_S24LE: "pcm_s24le",
    speech_pb2.PCM_S32LE: "pcm_s32le",
    speech_pb2.PCM_F32LE: "pcm_f32le",
    speech_pb2.MULAW: "mulaw",
    speech_pb2.ALAW: "alaw",
}


def _metadata_text(value: str) -> str:
    """A client-chosen name as a gRPC metadata value: printable ASCII only (grpc refuses the
    whole reply with INTERNAL otherwise), the rest percent-encoded, and bounded."""
    from urllib.parse import quote

    return quote(value[:128], safe=" !#$&'()*+,/:;=?@[]~{}|^`<>\"")


class SpeechServicer(speech_pb2_grpc.SpeechServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state

    def _check_auth(self, context: aio.ServicerContext) -> None:
        key = self.state.config.api_key
        if key is None:
            return
        for item in context.invocation_metadata() or ():
            if item.key == "authorization":
                scheme, _, token = str(item.value).partition(" ")
                if scheme.lower() == "bearer" and hmac.compare_digest(
                    token.strip().encode(), key.encode()
                ):
                    return
        raise AuthenticationError(
            "missing or incorrect API key; send metadata 'authorization: Bearer <key>'"
        )

    def _error_metadata(self, exc: OASRError) -> tuple[tuple[str, str], ...]:
        """The trailing metadata of an error: its code and field, as the HTTP error body; a full
        queue also says when to retry (``retry-after``, seconds, as HTTP's header)."""
        trailing = [("oasr-error-code", exc.code)]
        if exc.param:
            trailing.append(("oasr-error-param", _metadata_text(exc.param)))
        if isinstance(exc, EngineOverloadedError):
            trailing.append(("retry-after", str(self.state.retry_after())))
        return tuple(trailing)

    async def _fail(self, exc: BaseException, context: aio.ServicerContext, where: str) -> Any:
        """Abort the call with the status (and trailing metadata) of ``exc``; returns the
        status for the metrics."""
        if not isinstance(exc, OASRError):
            log.error("unhandled error in %s", where, exc_info=exc)
            exc = EngineFailureError("internal server error; the failure is in the server log")
        self.state.metrics_error(exc)
        status = STATUS_FOR_HTTP.get(exc.http_status, grpc.StatusCode.INTERNAL)
        context.set_trailing_metadata(self._error_metadata(exc))
        await context.abort(status, exc.message)

    def _config_options(self, cfg: Any, engine: Any) -> Any:
        """Validated DecodingOptions from a RecognitionConfig (unary and streaming alike)."""
        from oasr_server.routes import _options

        self.state.check_model(cfg.model or None)
        if not 0.0 <= cfg.temperature <= 1.0:
            raise InvalidRequestError("temperature must be between 0 and 1", param="temperature")
        if cfg.beam_size < 0 or cfg.beam_size > 64:
            raise InvalidRequestError("beam_size must be between 0 and 64", param="beam_size")
        options = _options(
            task="translate" if cfg.task == speech_pb2.TRANSLATE else "transcribe",
            language=cfg.language or None,
            prompt=cfg.prompt or None,
            temperature=float(cfg.temperature),
            words=cfg.word_timestamps,
            beam_size=cfg.beam_size or 1,
            extra=dict(cfg.model_options),
        )
        options.validate_for(engine.model)  # family options included: refused before any work
        return options

    async def StreamingRecognize(  # noqa: N802 - gRPC method name
        self, request_iterator: Any, context: aio.ServicerContext
    ) -> Any:
        from oasr_server.streaming import InputFormat, StreamEvent, TurnStream, VADSettings

        state = self.state
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        stream: TurnStream | None = None
        feeder: asyncio.Task[None] | None = None
        slot = False
        try:
            self._check_auth(context)
            engine, _ = state.require_ready()
            try:
                first = await request_iterator.__anext__()
            except StopAsyncIteration:
                raise InvalidRequestError(
                    "the stream ended before its streaming_config", param="streaming_config"
                ) from None
            if first.WhichOneof("streaming_request") != "streaming_config":
                raise InvalidRequestError(
                    "the first message must carry streaming_config", param="streaming_config"
                )
            sc = first.streaming_config
            cfg = sc.config
            options = self._config_options(cfg, engine)
            if cfg.encoding not in _ENCODINGS:
                raise InvalidRequestError(
                    "streaming needs headerless audio: set config.encoding (PCM_S16LE, MULAW, "
                    "...) and config.sample_rate_hertz",
                    param="encoding",
                )
            if cfg.sample_rate_hertz <= 0:
                raise InvalidRequestError(
                    "streaming needs config.sample_rate_hertz", param="sample_rate_hertz"
                )
            if sc.interim_interval_ms < 0:
                raise InvalidRequestError(
                    "interim_interval_ms must be >= 0", param="interim_interval_ms"
                )
            va = sc.voice_activity
            vad = None
            if va.enabled:
                if (
                    not 0.0 <= va.threshold <= 1.0
                    or va.prefix_padding_ms < 0
                    or (va.silence_duration_ms < 0)
                ):
                    raise InvalidRequestError(
                        "voice_activity: threshold must be in [0, 1], durations >= 0",
                        param="voice_activity",
                    )
                d = VADSettings()
                vad = VADSettings(
                    threshold=va.threshold or d.threshold,
                    prefix_padding_ms=va.prefix_padding_ms or d.prefix_padding_ms,
                    silence_duration_ms=max(32, va.silence_duration_ms or d.silence_duration_ms),
                )
            fmt = InputFormat(
                encoding=_ENCODINGS[cfg.encoding],
                sample_rate=cfg.sample_rate_hertz,
                channels=cfg.audio_channel_count or 1,
            )
            state.open_stream("grpc")
            slot = True
            out: asyncio.Queue[Any] = asyncio.Queue()
            index: dict[str, int] = {}
            spans: dict[str, tuple[float, float]] = {}

            def utterance(item_id: str) -> int:
                return index.setdefault(item_id, len(index))

            def emit(ev: StreamEvent) -> None:
                if ev.kind == "speech_started":
                    utterance(ev.item_id)
                    out.put_nowait(
                        speech_pb2.StreamingRecognizeResponse(
                            speech_event_type=speech_pb2.SPEECH_ACTIVITY_BEGIN,
                            speech_event_time=ev.start_s or 0.0,
                        )
                    )
                elif ev.kind == "speech_stopped":
                    out.put_nowait(
                        speech_pb2.StreamingRecognizeResponse(
                            speech_event_type=speech_pb2.SPEECH_ACTIVITY_END,
                            speech_event_time=ev.end_s or 0.0,
                        )
                    )
                elif ev.kind == "committed":
                    utterance(ev.item_id)
                    spans[ev.item_id] = (ev.start_s or 0.0, ev.end_s or 0.0)
                elif ev.kind == "partial":
                    out.put_nowait(
                        speech_pb2.StreamingRecognizeResponse(
                            result=speech_pb2.StreamingRecognitionResult(
                                text=ev.text,
                                stable_text=ev.stable,
                                is_final=False,
                                utterance_index=utterance(ev.item_id),
                            )
                        )
                    )
                elif ev.kind == "completed":
                    t = ev.transcript
                    start, end = spans.get(ev.item_id, (0.0, 0.0))
                    assert t is not None
                    out.put_nowait(
                        speech_pb2.StreamingRecognizeResponse(
                            result=speech_pb2.StreamingRecognitionResult(
                                text=t.text,
                                is_final=True,
                                utterance_index=utterance(ev.item_id),
                                start=start,
                                end=end,
                                language=t.language or "",
                                segments=[
                                    speech_pb2.Segment(
                                        id=s.id,
                                        start=s.start + start,
                                        end=s.end + start,
                                        text=s.text,
                                        confidence=s.confidence,
                                        no_speech_prob=s.no_speech_prob,
                                    )
                                    for s in t.segments
                                ],
                                words=[
                                    speech_pb2.Word(
                                        word=w.word,
                                        start=w.start + start,
                                        end=w.end + start,
                                        confidence=w.confidence,
                                    )
                                    for w in t.words
                                ],
                            )
                        )
                    )
                elif ev.kind == "failed":
                    out.put_nowait(ev.error)

            stream = TurnStream(
                state,
                api="grpc",
                fmt=fmt,
                options=options,
                emit=emit,
                partial_interval_ms=(sc.interim_interval_ms or None) if sc.interim_results else 0,
                route=STREAM_METHOD,
            )
            if vad is not None:
                await stream.set_vad(vad)

            async def feed() -> None:
                assert stream is not None
                async for req in request_iterator:
                    if req.WhichOneof("streaming_request") != "audio_content":
                        raise InvalidRequestError(
                            "only the first message may carry streaming_config",
                            param="streaming_config",
                        )
                    await stream.append(req.audio_content)
                await stream.finish()

            feeder = asyncio.get_running_loop().create_task(feed())
            feeder.add_done_callback(lambda _t: out.put_nowait(_DONE))
            while True:
                item = await out.get()
                if item is _DONE:
                    break
                if isinstance(item, BaseException):
                    raise item
                yield item
            feeder.result()  # the feeder's failure, if any
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a gRPC status
            if isinstance(exc, aio.AbortError):
                raise
            from oasr_server.errors import TooManyStreamsError

            if isinstance(exc, TooManyStreamsError):
                state.metrics.streams_total.labels("grpc", "rejected").inc()
            status = (
                STATUS_FOR_HTTP.get(getattr(exc, "http_status", 500), grpc.StatusCode.INTERNAL)
                if isinstance(exc, OASRError)
                else grpc.StatusCode.INTERNAL
            )
            await self._fail(exc, context, "StreamingRecognize")
        finally:
            if feeder is not None and not feeder.done():
                feeder.cancel()
                await asyncio.gather(feeder, return_exceptions=True)
            if stream is not None:
                await stream.aclose()
            if slot:
                state.close_stream("grpc", "closed" if status == grpc.StatusCode.OK else "error")
            m = state.metrics
            m.requests.labels(STREAM_METHOD, "GRPC", status.name).inc()
            m.latency.labels(STREAM_METHOD).observe(time.perf_counter() - started)

    async def Recognize(  # noqa: N802 - gRPC method name
        self, request: speech_pb2.RecognizeRequest, context: aio.ServicerContext
    ) -> speech_pb2.RecognizeResponse:

        state = self.state
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        try:
            self._check_auth(context)
            engine, worker = state.require_ready()
            cfg = request.config
            options = self._config_options(cfg, engine)
            raw_format = None
            if cfg.encoding != speech_pb2.ENCODING_UNSPECIFIED:
                from oasr.audio import RawPCMFormat

                if cfg.encoding not in _ENCODINGS:
                    raise InvalidRequestError(f"unknown encoding {cfg.encoding}", param="encoding")
                if cfg.sample_rate_hertz <= 0:
                    raise InvalidRequestError(
                        "headerless PCM needs sample_rate_hertz", param="sample_rate_hertz"
                    )
                raw_format = RawPCMFormat(
                    sample_rate=cfg.sample_rate_hertz,
                    encoding=_ENCODINGS[cfg.encoding],  # type: ignore[arg-type]
                    channels=cfg.audio_channel_count or 1,
                )
            if len(request.audio) > state.config.max_upload_bytes:
                raise UploadTooLargeError(
                    f"the audio is {len(request.audio)} bytes; this server accepts at most "
                    f"{state.config.max_upload_bytes} bytes (--max-upload-bytes)",
                    param="audio",
                )
            timeout = state.config.request_timeout
            remaining = context.time_remaining()
            if remaining is not None:
                timeout = min(timeout, remaining)
            deadline = time.monotonic() + timeout
            audio = await state.decode(request.audio, engine.sample_rate, METHOD, raw_format)
            t = await state.transcribe(worker, audio, options, deadline)
            return speech_pb2.RecognizeResponse(
                model=state.config.served_model_name,
                text=t.text,
                language=t.language or "",
                duration=t.duration,
                task=t.task,
                segments=[
                    speech_pb2.Segment(
                        id=s.id,
                        start=s.start,
                        end=s.end,
                        text=s.text,
                        confidence=s.confidence,
                        no_speech_prob=s.no_speech_prob,
                    )
                    for s in t.segments
                ],
                words=[
                    speech_pb2.Word(word=w.word, start=w.start, end=w.end, confidence=w.confidence)
                    for w in t.words
                ],
            )
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:  # noqa: BLE001 - every failure becomes a gRPC status
            if not isinstance(exc, OASRError):
                log.exception("unhandled error in Recognize")
                exc = EngineFailureError("internal server error; the failure is in the server log")
            state.metrics_error(exc)
            status = STATUS_FOR_HTTP.get(exc.http_status, grpc.StatusCode.INTERNAL)
            context.set_trailing_metadata(self._error_metadata(exc))
            await context.abort(status, exc.message)
            raise  # unreachable: abort raises
        finally:
            m = state.metrics
            m.requests.labels(METHOD, "GRPC", status.name).inc()
            m.latency.labels(METHOD).observe(time.perf_counter() - started)


async def start_grpc_server(state: ServerState, bind: str) -> Any:
    """Start the gRPC server on ``bind`` (``HOST:PORT``); returns the ``grpc.aio`` server with its
    bound port as ``server.oasr_port``."""
    limit = state.config.max_upload_bytes + 64 * 1024
    server = aio.server(
        options=[
            ("grpc.max_receive_message_length", limit),
            ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ]
    )
    speech_pb2_grpc.add_SpeechServicer_to_server(SpeechServicer(state), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def mark_serving() -> None:
        for name in ("", SERVICE):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)

    def spawn() -> None:
        task = loop.create_task(mark_serving())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def became_ready() -> None:  # runs in the loader thread
        loop.call_soon_threadsafe(spawn)

    state.add_ready_listener(became_ready)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"could not bind the gRPC server to {bind}")
    await server.start()
    server.oasr_port = port
    server.oasr_health = health_servicer
    log.info("gRPC %s listening on %s", SERVICE, bind.rsplit(":", 1)[0] + f":{port}")
    return server

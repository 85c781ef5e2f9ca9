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

from oasr.errors import InvalidRequestError, OASRError
from oasr_server.errors import AuthenticationError, EngineFailureError, UploadTooLargeError
from oasr_server.grpc_api import speech_pb2, speech_pb2_grpc

if TYPE_CHECKING:
    from oasr_server.app import ServerState

log = logging.getLogger("oasr_server.grpc")

SERVICE = speech_pb2.DESCRIPTOR.services_by_name["Speech"].full_name  # oasr.speech.v1.Speech
METHOD = f"/{SERVICE}/Recognize"

STATUS_FOR_HTTP = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    413: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
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

    async def Recognize(  # noqa: N802 - gRPC method name
        self, request: speech_pb2.RecognizeRequest, context: aio.ServicerContext
    ) -> speech_pb2.RecognizeResponse:
        from oasr_server.routes import _options

        state = self.state
        started = time.perf_counter()
        status = grpc.StatusCode.OK
        try:
            self._check_auth(context)
            engine, worker = state.require_ready()
            cfg = request.config
            state.check_model(cfg.model or None)
            if not 0.0 <= cfg.temperature <= 1.0:
                raise InvalidRequestError(
                    "temperature must be between 0 and 1", param="temperature"
                )
            if cfg.beam_size < 0 or cfg.beam_size > 64:
                raise InvalidRequestError("beam_size must be between 0 and 64", param="beam_size")
            options = _options(
                task="translate" if cfg.task == speech_pb2.TRANSLATE else "transcribe",
                language=cfg.language or None,
                prompt=cfg.prompt or None,
                temperature=float(cfg.temperature),
                words=cfg.word_timestamps,
                beam_size=cfg.beam_size or 1,
            )
            options.check_supported(engine.model.capabilities, engine.model.name)
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
            trailing = [("oasr-error-code", exc.code)]
            if exc.param:
                trailing.append(("oasr-error-param", exc.param))
            context.set_trailing_metadata(tuple(trailing))
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

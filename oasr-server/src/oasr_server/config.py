"""Server settings (plain dataclass; no heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass

from oasr.errors import InvalidRequestError


@dataclass
class ServerConfig:
    """Everything the HTTP layer is configured with. Engine settings travel separately in an
    :class:`oasr.types.EngineConfig`."""

    #: Largest accepted request body in bytes (checked while the body is read).
    max_upload_bytes: int = 25 * 1024 * 1024
    #: Longest accepted audio in seconds (checked while decoding).
    max_audio_seconds: float = 3600.0
    #: Requests allowed to wait for the engine; one more is answered 503 ``overloaded``.
    max_queue: int = 64
    #: Seconds from acceptance to answer before a request is answered 504.
    request_timeout: float = 600.0
    #: Bearer token required on every route but /healthz and /readyz (None: no check).
    api_key: str | None = None
    #: Model id shown by /v1/models and accepted in the ``model`` field.
    served_model_name: str = "oasr"
    #: Other ``model`` values accepted as the served model (OpenAI clients send "whisper-1").
    model_aliases: tuple[str, ...] = ("whisper-1",)
    #: The batch size the engine worker plans with (``max_concurrency``'s default; None: the
    #: engine's ``max_batch_size``, which bounds every model call).
    max_batch_size: int | None = None
    #: Concurrent audio decodes in threads, when no decode processes are used (never on the
    #: event loop); also the number of VAD threads.
    decode_threads: int = 4
    #: Worker processes that decode uploads (``oasr.decode_pool``), so decoding never holds the
    #: engine process's GIL. None: ``default_decode_processes()`` (half the cores, at most 8;
    #: none below 4 cores); 0: decode in ``decode_threads`` threads instead.
    decode_processes: int | None = None
    #: Run one short transcription before reporting ready.
    warmup: bool = True
    #: Seconds an ``overloaded`` answer asks the client to wait (Retry-After).
    retry_after_s: int = 1
    #: ``HOST:PORT`` for the gRPC API (``oasr.speech.v1.Speech``, health, reflection); None: off.
    #: Port 0 picks a free port (see ``app.state.grpc_server.oasr_port``).
    grpc_bind: str | None = None
    #: Live streams (``/v1/realtime`` WebSockets plus gRPC ``StreamingRecognize`` calls); one
    #: more is refused (WebSocket close code 1013, gRPC ``RESOURCE_EXHAUSTED``).
    max_streams: int = 64
    #: Interim results: a turn still growing is re-transcribed after every this many ms of new
    #: audio (offline mode; a streaming engine's partials follow its chunks instead). 0: no
    #: interim results, only the final transcript of each turn.
    partial_interval_ms: int = 1000
    #: Most requests in the engine at once, running or waiting in its scheduler (None:
    #: ``max_batch_size`` with a continuous-batching executor, twice that with the
    #: ``BatchExecutor``: the next batch gathers while one runs); the others wait in the queue.
    max_concurrency: int | None = None
    #: Seconds a ``/v1/realtime`` WebSocket may stay silent (no message from the client) before
    #: the server sends an ``idle_timeout`` error and closes it with code 1008 (0: no limit).
    realtime_idle_timeout: float = 300.0
    #: Browser origins (``https://app.example``) allowed to call the API and open the realtime
    #: WebSocket, with CORS for them; ``"*"``: any. Empty (the default): same origin only (a
    #: request whose ``Origin`` names another host is 403 ``origin_not_allowed``; clients that
    #: send no ``Origin``, i.e. everything but browsers, are unaffected).
    allowed_origins: tuple[str, ...] = ()
    #: Serve the browser demo page at ``/demo`` (:mod:`oasr_server.demo`; public, holds no key).
    demo: bool = True
    #: Most uncommitted audio a live stream (realtime, gRPC StreamingRecognize) may buffer, in
    #: seconds (also bounded by ``max_audio_seconds``): a VAD turn that long is committed, a
    #: manual buffer past it drops its oldest audio with an ``audio_too_long`` error, and one
    #: append holding more is refused whole.
    #: An upload that sends nothing for this many seconds is answered 408 ``upload_timeout``;
    #: after this long, its average rate must also stay above ``upload_min_rate`` (0: no limit).
    upload_idle_timeout: float = 15.0
    #: Slowest accepted upload, in bytes per second on average (checked once the upload has
    #: run ``upload_idle_timeout`` seconds; 0: no minimum).
    upload_min_rate: int = 4096
    #: Most request-body bytes being received at once, across connections (declared
    #: ``Content-Length`` reserved up front): one more upload is 503 ``overloaded``.
    max_receiving_bytes: int = 512 * 1024 * 1024
    #: Most decoded upload audio held at once (seconds, summed over requests between decoding
    #: and answer: 64 KB per second at 16 kHz); an upload that would pass it is 503
    #: ``overloaded`` right after decoding, and its audio freed.
    max_pending_audio_seconds: float = 14400.0
    #: Decoding work bound for autoregressive models: a request that does not set
    #: ``max_new_tokens`` gets ``32 + this x its seconds`` (rounded up to a multiple of 32)
    #: when that is at most 224 (Whisper's window budget), so a short or broken clip cannot
    #: generate a full window of tokens in every temperature-fallback round (0: no bound).
    max_tokens_per_second: float = 20.0
    #: Most temperature-fallback rounds per window after the first decoding: a request's
    #: temperature schedule is cut to its first ``1 + this`` temperatures (the default schedule
    #: 0.0, 0.2, ..., 1.0 becomes 0.0, 0.2, 0.4), so with ``max_tokens_per_second`` a window's
    #: decoding work is at most ``(1 + this) x`` its token budget (None: no cap).
    max_fallback_rounds: int | None = 2
    #: Seconds of audio the engine's admission scan (Whisper's VAD gate) covers per scheduler
    #: step, summed over the requests being scanned (``SchedulerConfig.gate_seconds_per_step``;
    #: None: the family's default, Whisper 30 s on CPU and 3600 s on CUDA)
    gate_seconds_per_step: float | None = None
    #: ``--service-mode streaming``: longest a streaming step holds (milliseconds, from the
    #: oldest ready chunk) for more streams to become ready, so that one model call serves more
    #: of them (``SchedulerConfig.stream_batch_wait_s``). 0: a step runs as soon as any stream
    #: is ready. A hold adds at most this much to a chunk's latency; a few ms pay off on a GPU.
    stream_batch_wait_ms: float = 0.0
    stream_buffer_seconds: float = 600.0
    #: The same bound in bytes of buffered audio (float32 at the model's rate: 64 KB per second
    #: at 16 kHz); the smaller of the two applies.
    stream_buffer_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.max_upload_bytes < 1:
            raise InvalidRequestError("max_upload_bytes must be >= 1", param="max_upload_bytes")
        if not self.max_audio_seconds > 0:
            raise InvalidRequestError("max_audio_seconds must be > 0", param="max_audio_seconds")
        if self.max_queue < 1:
            raise InvalidRequestError("max_queue must be >= 1", param="max_queue")
        if not self.request_timeout > 0:
            raise InvalidRequestError("request_timeout must be > 0", param="request_timeout")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise InvalidRequestError("max_batch_size must be >= 1", param="max_batch_size")
        if self.max_streams < 0:
            raise InvalidRequestError("max_streams must be >= 0", param="max_streams")
        if self.partial_interval_ms < 0:
            raise InvalidRequestError(
                "partial_interval_ms must be >= 0", param="partial_interval_ms"
            )
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise InvalidRequestError("max_concurrency must be >= 1", param="max_concurrency")
        if self.realtime_idle_timeout < 0:
            raise InvalidRequestError(
                "realtime_idle_timeout must be >= 0", param="realtime_idle_timeout"
            )
        if self.decode_processes is not None and self.decode_processes < 0:
            raise InvalidRequestError("decode_processes must be >= 0", param="decode_processes")
        if not self.stream_buffer_seconds > 0:
            raise InvalidRequestError(
                "stream_buffer_seconds must be > 0", param="stream_buffer_seconds"
            )
        if self.stream_buffer_bytes < 4096:
            raise InvalidRequestError(
                "stream_buffer_bytes must be >= 4096", param="stream_buffer_bytes"
            )
        if self.upload_idle_timeout < 0 or self.upload_min_rate < 0:
            raise InvalidRequestError(
                "upload_idle_timeout and upload_min_rate must be >= 0", param="upload_min_rate"
            )
        if self.max_receiving_bytes < 1:
            raise InvalidRequestError(
                "max_receiving_bytes must be >= 1", param="max_receiving_bytes"
            )
        if not self.max_pending_audio_seconds > 0:
            raise InvalidRequestError(
                "max_pending_audio_seconds must be > 0", param="max_pending_audio_seconds"
            )
        if self.max_fallback_rounds is not None and self.max_fallback_rounds < 0:
            raise InvalidRequestError(
                "max_fallback_rounds must be >= 0", param="max_fallback_rounds"
            )
        if self.gate_seconds_per_step is not None and not self.gate_seconds_per_step > 0:
            raise InvalidRequestError(
                "gate_seconds_per_step must be > 0", param="gate_seconds_per_step"
            )
        if not self.stream_batch_wait_ms >= 0:
            raise InvalidRequestError(
                "stream_batch_wait_ms must be >= 0", param="stream_batch_wait_ms"
            )
        if self.decode_threads < 1:
            raise InvalidRequestError("decode_threads must be >= 1", param="decode_threads")

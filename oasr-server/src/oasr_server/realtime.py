"""``GET /v1/realtime``: the transcription subset of OpenAI's Realtime API over a WebSocket.

Client events: ``session.update`` (the beta name ``transcription_session.update`` is accepted
too), ``input_audio_buffer.append`` / ``.commit`` / ``.clear``. Server events, named as the
current (GA) Realtime API names them for a transcription session, so the ``openai`` SDK parses
each into its own model: ``session.created`` (with or without ``?intent=transcription``),
``session.updated`` (the answer to either update event), ``input_audio_buffer.speech_started`` /
``.speech_stopped`` / ``.committed`` / ``.cleared``, ``conversation.item.created``,
``conversation.item.input_audio_transcription.delta`` / ``.completed`` / ``.failed`` and
``error`` (OpenAI's shape; the socket stays open after recoverable errors). The session object
carries the GA shape and the beta fields side by side (:meth:`SessionConfig.to_json`).

The turn logic (buffer, server VAD, interim deltas, ordered finals) is
:class:`oasr_server.streaming.TurnStream`; this module is the protocol.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from oasr.errors import InvalidRequestError, OASRError
from oasr_server import jsonsafe
from oasr_server.streaming import InputFormat, StreamEvent, TurnStream, VADSettings, new_id

if TYPE_CHECKING:
    from oasr_server.app import ServerState

log = logging.getLogger("oasr_server.realtime")

ROUTE = "/v1/realtime"
#: model names OpenAI realtime clients send; all mean the served model here
REALTIME_MODEL_ALIASES = ("gpt-4o-transcribe", "gpt-4o-mini-transcribe", "whisper-1")
KEY_PROTOCOL = "openai-insecure-api-key."
#: close codes
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN = 1013

FORMATS = {
    "pcm16": ("pcm_s16le", 24000),
    "g711_ulaw": ("mulaw", 8000),
    "g711_alaw": ("alaw", 8000),
}
#: GA-style format objects ({"type": "audio/pcm", "rate": 24000})
GA_FORMATS = {"audio/pcm": "pcm16", "audio/pcmu": "g711_ulaw", "audio/pcma": "g711_alaw"}
GA_FORMAT_NAMES = {name: ga for ga, name in GA_FORMATS.items()}
PCM_RATES = (8000, 16000, 24000, 44100, 48000)
CLIENT_EVENTS = (
    "transcription_session.update",
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
)


#: ``json.dumps(event, ensure_ascii=False)`` without building an encoder per server event
_dumps = json.JSONEncoder(ensure_ascii=False).encode
#: how common encoders write an ``input_audio_buffer.append`` event that has only its type and
#: audio, type first (Python's ``json.dumps``, compact ``JSON.stringify``): ``_plain_append``
_APPEND_HEADS = (
    '{"type": "input_audio_buffer.append", "audio": "',
    '{"type":"input_audio_buffer.append","audio":"',
)


def _plain_append(text: str) -> bytes | None:
    """The audio of ``text`` when it is an ``input_audio_buffer.append`` event written as
    :data:`_APPEND_HEADS` + base64 + ``"}``, decoded without parsing the JSON (the parse cost
    a sixth of an append's own work on the event loop); None for anything else, which is
    parsed as JSON. Exact: ``b64decode(validate=True)`` accepts only the base64 alphabet, no
    quote, backslash or control character, so such text is that event as JSON too, with those
    bytes; text it refuses goes through the JSON path, which reports what it reported."""
    if not text.endswith('"}'):
        return None
    for head in _APPEND_HEADS:
        if text.startswith(head) and len(text) >= len(head) + 2:
            try:
                return base64.b64decode(text[len(head) : -2], validate=True)
            except (binascii.Error, ValueError):
                return None
    return None


class RealtimeError(InvalidRequestError):
    """A client event this server refuses (``code`` as OpenAI names it)."""

    def __init__(self, message: str, *, code: str = "invalid_value", param: str | None = None):
        super().__init__(message, param=param)
        self.code = code


# -- session settings --------------------------------------------------------------------------


class SessionConfig:
    def __init__(self, model: str) -> None:
        self.format_name = "pcm16"
        self.pcm_rate = 24000
        self.model = model
        self.language: str | None = None
        self.prompt: str | None = None
        #: decoding options by name (OASR extension ``input_audio_transcription.model_options``)
        self.model_options: dict[str, Any] = {}
        self.vad: VADSettings | None = VADSettings()
        self.noise_reduction: Any = None
        self.include: Any = None

    def copy(self) -> SessionConfig:
        other = SessionConfig(self.model)
        other.__dict__.update(self.__dict__)
        return other

    def input_format(self) -> InputFormat:
        encoding, rate = FORMATS[self.format_name]
        if self.format_name == "pcm16":
            rate = self.pcm_rate
        return InputFormat(encoding=encoding, sample_rate=rate)

    def to_json(self, session_id: str) -> dict[str, Any]:
        """The session as ``session.created`` / ``session.updated`` carry it: the GA shape of a
        transcription session (``type: "transcription"``, ``audio.input.{format, transcription,
        turn_detection, noise_reduction}``, what the current ``openai`` SDK parses as
        ``RealtimeTranscriptionSessionCreateRequest``) with the beta fields beside it
        (``input_audio_format``, ``input_audio_transcription``, ``turn_detection``, ...) for
        clients written against the beta API."""
        vad = self.vad
        turn = (
            None
            if vad is None
            else {
                "type": "server_vad",
                "threshold": vad.threshold,
                "prefix_padding_ms": int(vad.prefix_padding_ms),
                "silence_duration_ms": int(vad.silence_duration_ms),
            }
        )
        transcription = {
            "model": self.model,
            "language": self.language,
            "prompt": self.prompt or "",
            **({"model_options": self.model_options} if self.model_options else {}),
        }
        rate = self.input_format().sample_rate
        ga_format: dict[str, Any] = {"type": GA_FORMAT_NAMES[self.format_name]}
        if self.format_name == "pcm16":
            ga_format["rate"] = rate
        return {
            "type": "transcription",
            "id": session_id,
            "object": "realtime.transcription_session",
            "expires_at": 0,
            "audio": {
                "input": {
                    "format": ga_format,
                    "transcription": transcription,
                    "turn_detection": turn,
                    "noise_reduction": self.noise_reduction,
                }
            },
            "include": self.include,
            # the beta shape of the same settings
            "input_audio_format": self.format_name,
            "input_audio_sample_rate": rate,
            "input_audio_transcription": transcription,
            "turn_detection": turn,
            "input_audio_noise_reduction": self.noise_reduction,
        }


def _num(obj: dict[str, Any], key: str, lo: float, hi: float, default: float, param: str) -> float:
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RealtimeError(
            f"Invalid type for '{param}.{key}': expected a number.",
            code="invalid_type",
            param=f"{param}.{key}",
        )
    if not lo <= value <= hi:
        raise RealtimeError(
            f"Invalid '{param}.{key}': expected a value between {lo:g} and {hi:g}, got {value}.",
            param=f"{param}.{key}",
        )
    return float(value)


def _turn_detection(value: Any, param: str) -> VADSettings | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RealtimeError(
            f"Invalid type for '{param}': expected an object or null.",
            code="invalid_type",
            param=param,
        )
    kind = value.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            f"Invalid value for '{param}.type': {kind!r}. Supported values are: 'server_vad'.",
            param=f"{param}.type",
        )
    if kind == "semantic_vad":  # no semantic model here: server VAD with its defaults
        return VADSettings()
    d = VADSettings()
    return VADSettings(
        threshold=_num(value, "threshold", 0.0, 1.0, d.threshold, param),
        prefix_padding_ms=_num(value, "prefix_padding_ms", 0, 10_000, d.prefix_padding_ms, param),
        silence_duration_ms=_num(
            value, "silence_duration_ms", 32, 10_000, d.silence_duration_ms, param
        ),
    )


def _format(cfg: SessionConfig, value: Any, param: str) -> None:
    if isinstance(value, dict):  # GA shape: {"type": "audio/pcm", "rate": 24000}
        kind = value.get("type")
        name = GA_FORMATS.get(kind) if isinstance(kind, str) else None
        if name is None:
            raise RealtimeError(
                f"Invalid value for '{param}.type': {value.get('type')!r}. Supported values "
                f"are: {', '.join(repr(k) for k in GA_FORMATS)}.",
                param=f"{param}.type",
            )
        cfg.format_name = name
        if name == "pcm16":
            rate = value.get("rate", 24000)
            if not isinstance(rate, int) or isinstance(rate, bool) or rate not in PCM_RATES:
                raise RealtimeError(
                    f"Invalid value for '{param}.rate': {rate!r}. Supported rates: "
                    f"{', '.join(map(str, PCM_RATES))}.",
                    param=f"{param}.rate",
                )
            cfg.pcm_rate = int(rate)
        return
    if not isinstance(value, str) or value not in FORMATS:  # a list or number is no format name
        raise RealtimeError(
            f"Invalid value for '{param}': {value!r}. Supported values are: "
            f"{', '.join(repr(k) for k in FORMATS)}.",
            param=param,
        )
    cfg.format_name = value


def _transcription(state: ServerState, cfg: SessionConfig, value: Any, param: str) -> None:
    if value is None:
        return
    if not isinstance(value, dict):
        raise RealtimeError(
            f"Invalid type for '{param}': expected an object.", code="invalid_type", param=param
        )
    model = value.get("model")
    if model:
        names = (
            state.config.served_model_name,
            *state.config.model_aliases,
            *REALTIME_MODEL_ALIASES,
        )
        if model not in names:
            raise RealtimeError(
                f"Model {model!r} is not served here; this server serves "
                f"{state.config.served_model_name!r}.",
                code="model_not_found",
                param=f"{param}.model",
            )
        cfg.model = model
    for key in ("language", "prompt"):
        if key in value:
            v = value[key]
            if v is not None and not isinstance(v, str):
                raise RealtimeError(
                    f"Invalid type for '{param}.{key}': expected a string.",
                    code="invalid_type",
                    param=f"{param}.{key}",
                )
            setattr(cfg, key, v or None)
    if "model_options" in value:  # OASR extension: decoding options by name
        extra = value["model_options"]
        if extra is not None and not isinstance(extra, dict):
            raise RealtimeError(
                f"Invalid type for '{param}.model_options': expected an object.",
                code="invalid_type",
                param=f"{param}.model_options",
            )
        cfg.model_options = dict(extra or {})
        if state.engine is not None:  # refused now, not at every utterance
            session_options(cfg).validate_for(state.engine.model)


def session_options(cfg: SessionConfig) -> Any:
    """The decoding options of a session's utterances."""
    from oasr_server.routes import _options

    return _options(
        task="transcribe",
        language=cfg.language,
        prompt=cfg.prompt,
        temperature=0.0,
        words=False,
        extra=cfg.model_options,
    )


def apply_update(state: ServerState, current: SessionConfig, session: Any) -> SessionConfig:
    """A new config from a ``session`` object (beta or GA shape); raises :class:`RealtimeError`
    and leaves ``current`` unchanged when anything is invalid."""
    if not isinstance(session, dict):
        raise RealtimeError(
            "Invalid type for 'session': expected an object.", code="invalid_type", param="session"
        )
    cfg = current.copy()
    ga_input = (
        session.get("audio", {}).get("input") if isinstance(session.get("audio"), dict) else None
    )
    if isinstance(ga_input, dict):  # GA: session.audio.input.{format,transcription,turn_detection}
        p = "session.audio.input"
        if "format" in ga_input:
            _format(cfg, ga_input["format"], f"{p}.format")
        if "transcription" in ga_input:
            _transcription(state, cfg, ga_input["transcription"], f"{p}.transcription")
        if "turn_detection" in ga_input:
            cfg.vad = _turn_detection(ga_input["turn_detection"], f"{p}.turn_detection")
        if "noise_reduction" in ga_input:
            cfg.noise_reduction = ga_input["noise_reduction"]
    if "input_audio_format" in session:
        _format(cfg, session["input_audio_format"], "session.input_audio_format")
    if "input_audio_sample_rate" in session:  # OASR extension for pcm16 at another rate
        rate = session["input_audio_sample_rate"]
        if rate not in PCM_RATES:
            raise RealtimeError(
                f"Invalid value for 'session.input_audio_sample_rate': {rate!r}. Supported "
                f"rates: {', '.join(map(str, PCM_RATES))}.",
                param="session.input_audio_sample_rate",
            )
        cfg.pcm_rate = int(rate)
    if "input_audio_transcription" in session:
        _transcription(
            state, cfg, session["input_audio_transcription"], "session.input_audio_transcription"
        )
    if "turn_detection" in session:
        cfg.vad = _turn_detection(session["turn_detection"], "session.turn_detection")
    if "input_audio_noise_reduction" in session:
        cfg.noise_reduction = session["input_audio_noise_reduction"]
    if "include" in session:
        include = session["include"]
        if include is not None and (
            not isinstance(include, list) or not all(isinstance(x, str) for x in include)
        ):
            raise RealtimeError(
                "Invalid type for 'session.include': expected an array of strings.",
                code="invalid_type",
                param="session.include",
            )
        if include and any("logprobs" in x for x in include):
            # refused, not silently dropped (as include=logprobs on the HTTP routes)
            raise RealtimeError(
                "'item.input_audio_transcription.logprobs' is not supported: this server's "
                "models do not return token log-probabilities.",
                code="unsupported_value",
                param="session.include",
            )
        cfg.include = include
    return cfg


# -- connection --------------------------------------------------------------------------------


def websocket_protocol() -> Any:
    """The WebSocket protocol class ``oasr-server`` gives uvicorn (its ``ws`` setting):
    uvicorn's sans-I/O ``websockets`` protocol, except that it stops reading a socket only when
    ``ws_max_queue`` (32) received messages wait for the application, as uvicorn's other
    ``websockets`` protocol does, not after every message. uvicorn's pauses the socket at each
    message and resumes it when the application takes the message: on the standard asyncio loop
    that is two ``epoll_ctl`` calls and a handle per message (25 us a pair on a 2-core box, a
    tenth of a realtime append's cost on the event loop; uvloop defers them). ``"auto"`` when
    that protocol is not importable."""
    try:
        from uvicorn.protocols.websockets.websockets_sansio_impl import (
            WebSocketsSansIOProtocol,
        )
    except ImportError:  # no websockets: uvicorn decides
        return "auto"

    class QueuedWebSocketsProtocol(WebSocketsSansIOProtocol):  # type: ignore[misc, valid-type]
        def send_receive_event_to_app(self) -> None:
            paused = self.read_paused
            self.read_paused = True  # the base class pauses unless it is paused already
            try:
                super().send_receive_event_to_app()
            finally:
                self.read_paused = paused
            # the base class's receive() resumes reading once the queue is empty
            if not paused and self.queue.qsize() >= max(1, self.config.ws_max_queue):
                self.read_paused = True
                self.transport.pause_reading()

    return QueuedWebSocketsProtocol


def _header(ws: WebSocket, name: str) -> str | None:
    return ws.headers.get(name)


def _authorized(ws: WebSocket, key: str, protocols: list[str]) -> bool:
    auth = _header(ws, "authorization") or ""
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
        return True
    for proto in protocols:
        if proto.startswith(KEY_PROTOCOL) and hmac.compare_digest(
            proto[len(KEY_PROTOCOL) :].encode(), key.encode()
        ):
            return True
    return False


def _pick_protocol(protocols: list[str]) -> str | None:
    """Browsers fail the handshake unless one offered subprotocol is echoed: prefer
    ``realtime``, then any that is not the key."""
    if not protocols:
        return None
    if "realtime" in protocols:
        return "realtime"
    for proto in protocols:
        if not proto.startswith(KEY_PROTOCOL):
            return proto
    return protocols[0]


def error_event(error: OASRError, client_event_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "error",
        "event_id": new_id("event"),
        "error": {
            "type": error.error_type,
            "code": error.code,
            "message": error.message,
            "param": error.param,
            "event_id": client_event_id,
        },
    }


async def realtime_endpoint(websocket: WebSocket) -> None:
    state: ServerState = websocket.app.state.oasr
    protocols = list(websocket.scope.get("subprotocols") or [])
    await websocket.accept(subprotocol=_pick_protocol(protocols))

    async def refuse(error: OASRError, code: int) -> None:
        state.metrics_error(error)
        state.metrics.streams_total.labels("realtime", "rejected").inc()
        try:
            await websocket.send_text(json.dumps(error_event(error)))
            await websocket.close(code=code, reason=error.code)
        except (WebSocketDisconnect, RuntimeError):
            pass

    from oasr_server.app import origin_allowed

    if not origin_allowed(websocket.scope, state.config.allowed_origins):
        from oasr_server.errors import OriginNotAllowedError

        await refuse(
            OriginNotAllowedError(
                "This Origin may not open a realtime session; the server's --allowed-origin "
                "lists the browser origins it accepts."
            ),
            CLOSE_POLICY,
        )
        return
    key = state.config.api_key
    if key is not None and not _authorized(websocket, key, protocols):
        from oasr_server.errors import AuthenticationError

        await refuse(
            AuthenticationError(
                "Missing or incorrect API key. Send 'Authorization: Bearer <key>' or the "
                f"'{KEY_PROTOCOL}<key>' subprotocol."
            ),
            CLOSE_POLICY,
        )
        return
    try:
        if state.draining:
            from oasr_server.errors import NotReadyError

            raise NotReadyError("The server is shutting down; reconnect to another instance.")
        state.require_ready()
        state.open_stream("realtime")
    except OASRError as exc:
        await refuse(exc, CLOSE_TRY_AGAIN)
        return
    outcome = "closed"
    session = RealtimeSession(state, websocket)
    state.sessions.add(session)
    try:
        await session.run()
    except Exception:  # noqa: BLE001
        outcome = "error"
        log.exception("realtime session failed")
    finally:
        state.sessions.discard(session)
        state.close_stream("realtime", outcome)


class RealtimeSession:
    def __init__(self, state: ServerState, websocket: WebSocket) -> None:
        self.state = state
        self.ws = websocket
        self.id = new_id("sess")
        #: the applied session, and the latest accepted one (updates queue behind audio)
        self.config = SessionConfig(state.config.served_model_name)
        self.requested = self.config
        self.out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        #: ordered work for the processor: (kind, payload, client event id)
        self.work: asyncio.Queue[tuple[str, Any, str | None]] = asyncio.Queue(maxsize=256)
        self.stream: TurnStream | None = None
        #: the processor (or the reader, for an append taken at once) is handling a client event
        self._busy = False
        #: when the client last sent an event (``time.monotonic()``; inf while one is handled)
        self._last_event = 0.0

    async def drain(self, deadline: float) -> None:
        """Shutdown: wait (until ``deadline``) for the client events already received to be
        processed, the committed turns to be answered and every event to be sent."""
        while time.monotonic() < deadline:
            stream = self.stream
            pending = stream is not None and stream.answering
            if not (self._busy or not self.work.empty() or pending or not self.out.empty()):
                return
            await asyncio.sleep(0.05)

    def send(self, event: dict[str, Any]) -> None:
        event.setdefault("event_id", new_id("event"))
        self.out.put_nowait(event)

    def send_error(self, error: OASRError, client_event_id: str | None = None) -> None:
        self.state.metrics_error(error)
        self.out.put_nowait(error_event(error, client_event_id))

    def _options(self, cfg: SessionConfig) -> Any:
        return session_options(cfg)

    # -- stream events -> OpenAI events ------------------------------------------------------
    def on_stream(self, ev: StreamEvent) -> None:
        item = ev.item_id
        if ev.kind == "speech_started":
            self.send(
                {
                    "type": "input_audio_buffer.speech_started",
                    "audio_start_ms": round(ev.start_s * 1000),
                    "item_id": item,
                }
            )
        elif ev.kind == "speech_stopped":
            self.send(
                {
                    "type": "input_audio_buffer.speech_stopped",
                    "audio_end_ms": round(ev.end_s * 1000),
                    "item_id": item,
                }
            )
        elif ev.kind == "committed":
            self.send(
                {
                    "type": "input_audio_buffer.committed",
                    "previous_item_id": ev.previous_item_id,
                    "item_id": item,
                }
            )
            self.send(
                {
                    "type": "conversation.item.created",
                    "previous_item_id": ev.previous_item_id,
                    "item": {
                        "id": item,
                        "object": "realtime.item",
                        "type": "message",
                        "status": "completed",
                        "role": "user",
                        "content": [{"type": "input_audio", "transcript": None}],
                    },
                }
            )
        elif ev.kind == "partial":
            if ev.delta:
                self.send(
                    {
                        "type": "conversation.item.input_audio_transcription.delta",
                        "item_id": item,
                        "content_index": 0,
                        "delta": ev.delta,
                    }
                )
        elif ev.kind == "completed":
            t = ev.transcript
            if ev.delta:
                self.send(
                    {
                        "type": "conversation.item.input_audio_transcription.delta",
                        "item_id": item,
                        "content_index": 0,
                        "delta": ev.delta,
                    }
                )
            self.send(
                {
                    "type": "conversation.item.input_audio_transcription.completed",
                    "item_id": item,
                    "content_index": 0,
                    "transcript": ev.text,
                    "language": t.language if t is not None else None,
                    "usage": {
                        "type": "duration",
                        "seconds": round(t.duration, 3) if t is not None else 0,
                    },
                }
            )
        elif ev.kind == "failed":
            err = ev.error
            self.send(
                {
                    "type": "conversation.item.input_audio_transcription.failed",
                    "item_id": item,
                    "content_index": 0,
                    "error": {
                        "type": err.error_type,
                        "code": err.code,
                        "message": err.message,
                        "param": err.param,
                    },
                }
            )

    # -- tasks -------------------------------------------------------------------------------
    async def _writer(self) -> None:
        while True:
            event = await self.out.get()
            if event is None:
                return
            await self.ws.send_text(_dumps(event))

    async def _processor(self) -> None:
        while True:
            kind, payload, event_id = await self.work.get()
            self._busy = True
            try:
                await self._process(kind, payload, event_id)
            except Exception as exc:  # noqa: BLE001 - a bug must not end the session silently
                self._failed(kind, exc, event_id)
            finally:
                self._busy = False

    def _failed(self, kind: str, exc: Exception, event_id: str | None) -> None:
        if isinstance(exc, OASRError):
            self.send_error(exc, event_id)
            return
        log.error("realtime: failed to process %s", kind, exc_info=exc)
        from oasr_server.errors import EngineFailureError

        self.send_error(
            EngineFailureError("internal error; the details are in the server log"), event_id
        )

    def _append_now(self, data: bytes, event_id: str | None) -> bool:
        """An append taken at once, on the event loop, when nothing is queued before it and the
        stream needs no thread for it (``TurnStream.append_now``): no hop through the work queue
        to the processor task (one task switch per append, a tenth of an append's cost on the
        event loop with hundreds of streams). False: queue it."""
        stream = self.stream
        if self._busy or not self.work.empty() or stream is None:
            return False
        self._busy = True
        try:
            return stream.append_now(data)
        except Exception as exc:  # noqa: BLE001 - as the processor reports it
            self._failed("append", exc, event_id)
            return True
        finally:
            self._busy = False

    async def _apply(self, cfg: SessionConfig) -> None:
        stream = self.stream
        assert stream is not None
        await stream.set_format(cfg.input_format())
        stream.set_options(self._options(cfg))
        try:
            await stream.set_vad(cfg.vad)
        except OASRError as exc:  # e.g. the VAD plugin is not installed
            cfg.vad = None
            self.config = cfg
            raise RealtimeError(
                f"server_vad is not available ({exc.message}); turn_detection is off, "
                "commit the buffer with input_audio_buffer.commit",
                code="vad_unavailable",
                param="session.turn_detection",
            ) from None
        self.config = cfg

    async def _process(self, kind: str, payload: Any, event_id: str | None) -> None:
        stream = self.stream
        assert stream is not None
        if kind == "append":
            await stream.append(payload)
        elif kind == "commit":
            stream.commit()
        elif kind == "clear":
            stream.clear()
            self.send({"type": "input_audio_buffer.cleared"})
        elif kind == "update":
            try:
                await self._apply(payload)
            finally:
                self.send({"type": "session.updated", "session": self.config.to_json(self.id)})
        elif kind == "start":
            try:
                await self._apply(self.config)
            except OASRError as exc:
                self.send_error(exc, event_id)

    # -- client events -----------------------------------------------------------------------
    async def _append(self, data: bytes, event_id: str | None) -> None:
        """An append's decoded audio: taken in place when it can be, else queued in order."""
        if data and not self._append_now(data, event_id):
            await self.work.put(("append", data, event_id))

    async def _dispatch(self, text: str) -> None:
        data = _plain_append(text)
        if data is not None:  # the usual append, as the JSON path below would take it
            await self._append(data, None)
            return
        try:
            event = jsonsafe.loads(text)
        except jsonsafe.JSONTooDeepError as exc:
            self.send_error(
                RealtimeError(f"The client event is not valid: {exc}.", code="invalid_json")
            )
            return
        except ValueError:
            event = None
        if not isinstance(event, dict):
            self.send_error(
                RealtimeError("The client event is not a JSON object.", code="invalid_json")
            )
            return
        event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        kind = event.get("type")
        try:
            if kind in ("transcription_session.update", "session.update"):
                cfg = apply_update(self.state, self.requested, event.get("session"))
                self.requested = cfg
                await self.work.put(("update", cfg, event_id))
            elif kind == "input_audio_buffer.append":
                audio = event.get("audio")
                if not isinstance(audio, str):
                    raise RealtimeError(
                        "Missing required parameter: 'audio' (base64 audio).",
                        code="missing_required_parameter",
                        param="audio",
                    )
                try:
                    data = base64.b64decode(audio, validate=True)
                except (binascii.Error, ValueError):
                    raise RealtimeError(
                        "Invalid 'audio': not valid base64.", code="invalid_value", param="audio"
                    ) from None
                await self._append(data, event_id)
            elif kind == "input_audio_buffer.commit":
                await self.work.put(("commit", None, event_id))
            elif kind == "input_audio_buffer.clear":
                await self.work.put(("clear", None, event_id))
            else:
                raise RealtimeError(
                    f"Invalid value: {kind!r}. This transcription server supports the client "
                    f"events {', '.join(repr(k) for k in CLIENT_EVENTS)}.",
                    param="type",
                )
        except OASRError as exc:
            self.send_error(exc, event_id)

    async def _close_idle(self, idle: float, writer: asyncio.Task[Any]) -> None:
        error = RealtimeError(
            f"No client event for {idle:g} s (--realtime-idle-timeout); closing the session.",
            code="idle_timeout",
        )
        self.send_error(error)  # counted in oasr_errors_total like every error event
        await self.out.put(None)
        try:  # let the writer flush the error event, then close
            await asyncio.wait_for(asyncio.shield(writer), timeout=2.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001
            pass
        try:
            await self.ws.close(code=CLOSE_POLICY, reason="idle_timeout")
        except (WebSocketDisconnect, RuntimeError, OSError):
            pass

    async def _reader(self) -> None:
        """Client events, one at a time, until the client goes away. ``_last_event`` is when
        the client last sent one (infinity while one is being handled: a full work queue is
        not the client's silence)."""
        while True:
            message = await self.ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            self._last_event = math.inf
            try:
                if message.get("text") is not None:
                    await self._dispatch(message["text"])
                else:
                    self.send_error(
                        RealtimeError(
                            "Binary frames are not supported; send JSON text events "
                            "(audio base64-encoded in input_audio_buffer.append).",
                            code="invalid_json",
                        )
                    )
            finally:
                self._last_event = time.monotonic()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.stream = TurnStream(
            self.state,
            api="realtime",
            fmt=self.config.input_format(),
            options=self._options(self.config),
            emit=self.on_stream,
            route=ROUTE,
        )
        writer = loop.create_task(self._writer())
        processor = loop.create_task(self._processor())
        self.send({"type": "session.created", "session": self.config.to_json(self.id)})
        await self.work.put(("start", None, None))
        started = time.monotonic()
        self._last_event = started
        # one reader task for the whole session, watched here: a task and an asyncio.wait per
        # client event cost more on the event loop than the event itself
        reader = loop.create_task(self._reader())
        try:
            while True:
                idle = self.state.config.realtime_idle_timeout
                timeout = None
                if idle > 0:
                    timeout = max(0.0, self._last_event + idle - time.monotonic())
                    if self._last_event == math.inf:
                        timeout = idle
                done, _ = await asyncio.wait(
                    {reader, writer, processor},
                    timeout=timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if not done:
                    if idle > 0 and time.monotonic() - self._last_event >= idle:
                        # the client sent nothing for --realtime-idle-timeout seconds
                        reader.cancel()
                        await self._close_idle(idle, writer)
                        break
                    continue
                if reader in done:  # the client went away (or a bug in reading)
                    exc = reader.exception()
                    if exc is not None and not isinstance(exc, (WebSocketDisconnect, OSError)):
                        raise exc
                    break
                # the writer or processor died: end the session
                reader.cancel()
                for task in (writer, processor):
                    if task in done and task.exception() is not None:
                        exc = task.exception()
                        if not isinstance(exc, (WebSocketDisconnect, OSError, RuntimeError)):
                            raise exc  # type: ignore[misc]
                break
        finally:
            # no awaits here: the session may be ending because its task is being cancelled
            log.debug("realtime session %s ended after %.1f s", self.id, time.monotonic() - started)
            for task in (reader, processor, writer):
                task.cancel()
            self.stream.abort()

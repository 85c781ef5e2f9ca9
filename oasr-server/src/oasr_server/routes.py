"""HTTP routes: OpenAI's audio API, models, probes, metrics and ``/v1/speech:recognize``."""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from oasr.errors import InvalidRequestError, OASRError
from oasr.formats import CONTENT_TYPES, RESPONSE_FORMATS, render
from oasr_server.app import ServerState, read_body
from oasr_server.errors import NotReadyError, error_body
from oasr_server.multipart import Form, UploadedFile, boundary_of, parse_multipart

if TYPE_CHECKING:
    from oasr.types import DecodingOptions, Transcript

log = logging.getLogger("oasr_server")

GRANULARITIES = ("word", "segment")
#: form fields of OpenAI's transcription and translation requests; every other field is a
#: decoding option (an OASR extension: common ones such as beam_size, or the model family's)
OPENAI_FIELDS = frozenset({
    "file", "model", "language", "prompt", "response_format", "temperature", "stream",
    "timestamp_granularities", "timestamp_granularities[]", "chunking_strategy",
    # accepted and ignored, as before: OpenAI features this server does not offer
    "include", "include[]", "known_speaker_names[]", "known_speaker_references[]",
})  # fmt: skip
#: options the route itself decides (translation or not; word timestamps come from
#: timestamp_granularities[]): not settable as extra fields
ROUTE_OPTIONS = {"task": "the route", "word_timestamps": "timestamp_granularities[]"}
#: query parameters of /v1/speech:recognize that are not decoding options
RECOGNIZE_PARAMS = frozenset({
    "model", "task", "word_timestamps", "language", "prompt", "temperature", "beam_size",
    "encoding", "sample_rate", "channels",
})  # fmt: skip
STREAM_FORMATS = ("json", "text")
_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off", ""}


def _bool(value: str | None, param: str) -> bool:
    if value is None:
        return False
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise InvalidRequestError(f"{param} must be true or false, not {value!r}", param=param)


def _float(value: str | None, param: str, lo: float, hi: float, default: float) -> float:
    if value is None or value.strip() == "":
        return default
    try:
        x = float(value)
    except ValueError:
        raise InvalidRequestError(f"{param} must be a number, not {value!r}", param=param) from None
    if not lo <= x <= hi:
        raise InvalidRequestError(
            f"{param} must be between {lo:g} and {hi:g}, not {x:g}", param=param
        )
    return x


def _int(value: str | None, param: str, lo: int, hi: int, default: int | None) -> int | None:
    if value is None or value.strip() == "":
        return default
    try:
        x = int(value)
    except ValueError:
        raise InvalidRequestError(
            f"{param} must be an integer, not {value!r}", param=param
        ) from None
    if not lo <= x <= hi:
        raise InvalidRequestError(f"{param} must be between {lo} and {hi}, not {x}", param=param)
    return x


def _text(form: Form, name: str) -> str | None:
    value = form.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a text field, not a file", param=name)
    value = value.strip()
    return value or None


def _raw_text(form: Form, name: str) -> str | None:
    """A text field as sent (a prompt's leading space matters to the model)."""
    value = form.get(name)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise InvalidRequestError(f"{name} must be a text field, not a file", param=name)
    return value


def _options(
    *,
    task: str,
    language: str | None,
    prompt: str | None,
    temperature: float,
    words: bool,
    beam_size: int | None = None,
    extra: Mapping[str, Any] | None = None,
) -> DecodingOptions:
    """The request's options; ``extra``: more options by name (common or the family's), as
    text, parsed and checked against the model by ``options.validate_for``."""
    from oasr.types import FALLBACK_TEMPERATURES, DecodingOptions

    extra = dict(extra or {})
    for name, owner in ROUTE_OPTIONS.items():
        if name in extra:
            raise InvalidRequestError(f"{name} is set by {owner} here", param=name)
    # temperature 0 means "greedy, raising the temperature when the output looks like a failure",
    # which is what OpenAI's whisper-1 and the oasr CLI do.
    temps: float | tuple[float, ...] = temperature if temperature > 0 else FALLBACK_TEMPERATURES
    fields = dict(beam_size=beam_size or 1, language=language, task=task, temperature=temps,
                  prompt=prompt, word_timestamps=words)  # fmt: skip
    return DecodingOptions.build(**(fields | extra))  # an extra beam_size wins over the default


def _extra_fields(form: Form) -> dict[str, Any]:
    """Form fields beyond OpenAI's: decoding options by name. ``NAME[]`` (repeatable) gives a
    list; a file there is refused."""
    from oasr_server.chunking import PARAM

    extra: dict[str, Any] = {}
    for key in form.fields:
        if key in OPENAI_FIELDS or (key.startswith(PARAM + "[") and key.endswith("]")):
            continue
        values = form.getlist(key)
        if any(not isinstance(v, str) for v in values):
            raise InvalidRequestError(f"{key} must be a text field, not a file", param=key)
        if key.endswith("[]"):
            extra[key[:-2]] = list(values)
        else:
            extra[key] = values[-1] if len(values) == 1 else list(values)
    return extra


def _declared_options(model: Any) -> dict[str, Any]:
    """The served family's decoding options with the model's defaults (what extra form fields
    may set), for ``/v1/models``."""
    from oasr.model import HasModelOptions

    if not isinstance(model, HasModelOptions) or model.default_options is None:
        return {}
    defaults = model.default_options
    return {
        name: {"type": spec.type_name, "default": getattr(defaults, name), "description": spec.doc}
        for name, spec in defaults.specs().items()
    }


async def _parse_form(request: Request, state: ServerState) -> Form:
    ctype = request.headers.get("content-type", "")
    boundary_of(ctype)  # refuse a non-multipart body before reading it
    body = await read_body(request, state.config.max_upload_bytes, state)
    if len(body) < 256 * 1024:
        return parse_multipart(body, ctype)
    # a large body is parsed in a thread: the event loop stays free
    return await anyio.to_thread.run_sync(parse_multipart, body, ctype)


def _is_path(alias: str) -> bool:
    import os

    return "/" in alias or os.sep in alias or alias.startswith(".")


def _deltas(text: str) -> list[str]:
    """Split ``text`` into word deltas whose concatenation is exactly ``text``."""
    parts = re.findall(r"\s*\S+", text)
    tail = text[len("".join(parts)) :]
    if tail:
        if parts:
            parts[-1] += tail
        else:
            parts = [tail]
    return parts


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event, ensure_ascii=False)}\n\n".encode()


def _done_event(transcript: Transcript) -> bytes:
    return _sse(
        {
            "type": "transcript.text.done",
            "text": transcript.text,
            "usage": {"type": "duration", "seconds": round(transcript.duration, 3)},
        }
    )


async def _stream_events(transcript: Transcript) -> AsyncIterator[bytes]:
    """A finished transcript as SSE: word deltas of its text, then the done event."""
    for delta in _deltas(transcript.text):
        yield _sse({"type": "transcript.text.delta", "delta": delta})
    yield _done_event(transcript)


async def _stream_pieces(
    first: Any, rest: AsyncIterator[Any], state: ServerState
) -> AsyncIterator[bytes]:
    """SSE from :meth:`ServerState.transcribe_pieces`: one delta per piece as the model decodes
    it, then the done event. The deltas add up to the final text: a model whose last pieces did
    not reach it gets the rest as one more delta (or, with no pieces at all, word deltas of the
    final text). A failure after the stream started is an ``error`` event (the status is sent)."""
    from oasr.types import Transcript

    sent = ""
    item = first
    try:
        while not isinstance(item, Transcript):
            if item:
                sent += item
                yield _sse({"type": "transcript.text.delta", "delta": item})
            item = await rest.__anext__()
        if not sent:
            for delta in _deltas(item.text):
                yield _sse({"type": "transcript.text.delta", "delta": delta})
        elif item.text.startswith(sent) and len(item.text) > len(sent):
            yield _sse({"type": "transcript.text.delta", "delta": item.text[len(sent) :]})
        yield _done_event(item)
    except OASRError as exc:
        state.metrics_error(exc)
        yield _sse({"type": "error", **error_body(exc)})
    except Exception:  # noqa: BLE001 - the status line is sent: report it in the stream
        log.exception("transcription stream failed")
        err = OASRError("internal server error; the failure is in the server log")
        yield _sse({"type": "error", **error_body(err)})
    finally:
        await rest.aclose()  # drops the engine work when the client went away


def _usage(transcript: Transcript) -> dict[str, Any]:
    """OpenAI's usage of a duration-billed model (``whisper-1``)."""
    return {"type": "duration", "seconds": round(transcript.duration, 3)}


def _openai_json(transcript: Transcript, response_format: str, grains: list[str]) -> dict:
    """OpenAI's ``json`` / ``verbose_json`` body, with ``usage``; verbose_json names the
    language (``"english"``) and keeps its segments when only word timestamps were asked."""
    if response_format == "json":
        return {"text": transcript.text, "usage": _usage(transcript)}
    from oasr.formats import to_verbose_json
    from oasr_server.languages import language_name

    body = to_verbose_json(transcript, include_words="word" in grains, include_segments=True)
    body["language"] = language_name(body.get("language"))
    body["usage"] = _usage(transcript)
    return body


def _check_include(form: Form) -> None:
    """``include[]``: OpenAI's only value is ``logprobs`` (token log-probabilities of the
    ``gpt-4o`` transcribe models), which no OASR model returns: refused, not silently dropped."""
    from oasr.errors import UnsupportedOptionError

    for key in ("include[]", "include"):
        for value in form.getlist(key):
            v = value.strip() if isinstance(value, str) else value
            if v == "logprobs":
                raise UnsupportedOptionError(
                    "include=logprobs is not supported: this server's models do not return "
                    "token log-probabilities (use response_format=verbose_json for per-segment "
                    "avg_logprob)",
                    param="include",
                )
            raise InvalidRequestError(
                f"include[] values must be 'logprobs', not {value!r}", param="include"
            )


def _chunking(form: Form) -> Any:
    """``chunking_strategy`` (one field: ``auto`` / JSON, or ``chunking_strategy[KEY]``)."""
    from oasr_server.chunking import PARAM, parse_chunking_strategy

    bracketed: dict[str, str] = {}
    for name in form.fields:
        if name.startswith(PARAM + "[") and name.endswith("]"):
            value = _text(form, name)
            bracketed[name[len(PARAM) + 1 : -1]] = value or ""
    return parse_chunking_strategy(_text(form, PARAM), bracketed)


def add_routes(app: FastAPI, state: ServerState) -> None:
    async def openai_audio(request: Request, task: str, route: str) -> Response:
        deadline = time.monotonic() + state.config.request_timeout
        engine, worker = state.require_ready()
        form = await _parse_form(request, state)
        upload = form.get("file")
        if upload is None:
            raise InvalidRequestError("the 'file' field with the audio is required", param="file")
        if not isinstance(upload, UploadedFile):
            raise InvalidRequestError(
                "'file' must be an uploaded file, not a text field", param="file"
            )
        state.check_model(_text(form, "model"))
        response_format = _text(form, "response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise InvalidRequestError(
                f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, "
                f"not {response_format!r}",
                param="response_format",
            )
        raw_grains = [
            g
            for key in ("timestamp_granularities[]", "timestamp_granularities")
            for g in form.getlist(key)
        ]
        grains: list[str] = []
        for g in raw_grains:
            if not isinstance(g, str) or g.strip() not in GRANULARITIES:
                raise InvalidRequestError(
                    f"timestamp_granularities[] values must be 'word' or 'segment', not {g!r}",
                    param="timestamp_granularities",
                )
            if g.strip() not in grains:
                grains.append(g.strip())
        if grains and response_format != "verbose_json":
            raise InvalidRequestError(
                "timestamp_granularities[] needs response_format=verbose_json",
                param="timestamp_granularities",
            )
        _check_include(form)
        stream = _bool(_text(form, "stream"), "stream")
        if stream and response_format not in STREAM_FORMATS:
            raise InvalidRequestError(
                f"stream=true works with response_format json or text, not {response_format!r}",
                param="stream",
            )
        options = _options(
            task=task,
            language=_text(form, "language"),
            prompt=_raw_text(form, "prompt"),
            temperature=_float(_text(form, "temperature"), "temperature", 0.0, 1.0, 0.0),
            words="word" in grains,
            extra=_extra_fields(form),
        )
        chunking = _chunking(form)
        # refuse what this model cannot do (family options included) before any decoding work
        options.validate_for(engine.model)
        audio = await state.decode(upload.data, engine.sample_rate, route)
        if stream and chunking is None:
            # token streaming: deltas go out as the model decodes them; a failure before the
            # first piece (overloaded, a bad input) is still a plain HTTP error
            pieces = state.transcribe_pieces(
                worker, audio, options, deadline, request.is_disconnected
            )
            try:
                first = await pieces.__anext__()
            except BaseException:
                await pieces.aclose()
                raise
            return StreamingResponse(
                _stream_pieces(first, pieces, state),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if chunking is not None:
            from oasr_server.chunking import transcribe_chunked

            transcript = await transcribe_chunked(
                state,
                worker,
                audio,
                engine.sample_rate,
                options,
                chunking,
                deadline,
                request.is_disconnected,
            )
        else:
            transcript = await state.transcribe(
                worker, audio, options, deadline, request.is_disconnected
            )
        if stream:
            return StreamingResponse(
                _stream_events(transcript),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        if response_format in ("json", "verbose_json"):
            return JSONResponse(_openai_json(transcript, response_format, grains))
        body = render(transcript, response_format)
        return Response(body, media_type=CONTENT_TYPES[response_format])

    @app.post("/v1/audio/transcriptions", tags=["openai"])
    async def transcriptions(request: Request) -> Response:
        """OpenAI's create-transcription: multipart ``file``, ``model``, ``language``, ``prompt``,
        ``response_format``, ``temperature``, ``timestamp_granularities[]``, ``stream``; any other
        field is a decoding option (``beam_size``, or the model family's, e.g.
        ``no_speech_threshold``); one the model does not understand is a 400 naming it."""
        return await openai_audio(request, "transcribe", "/v1/audio/transcriptions")

    @app.post("/v1/audio/translations", tags=["openai"])
    async def translations(request: Request) -> Response:
        """OpenAI's create-translation (speech in any language to English text)."""
        return await openai_audio(request, "translate", "/v1/audio/translations")

    def model_entry() -> dict[str, Any]:
        entry: dict[str, Any] = {
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.started_at,
            "owned_by": "oasr",
            "ready": state.ready,
        }
        if state.engine is not None:
            model = state.engine.model
            caps = model.capabilities
            entry["oasr"] = {
                "name": model.name,
                "decode_family": getattr(caps.decode_family, "value", str(caps.decode_family)),
                "word_timestamps": caps.word_timestamps,
                "translation": caps.translation,
                "language_detection": caps.language_detection,
                "multilingual": caps.multilingual,
                "sample_rate": model.feature_spec.sample_rate,
                # a checkpoint path is an accepted alias too, but never shown (a server path)
                "aliases": [a for a in state.config.model_aliases if not _is_path(a)],
                "model_options": _declared_options(model),
            }
        return entry

    @app.get("/v1/models", tags=["openai"])
    async def models() -> JSONResponse:
        """OpenAI's list-models shape; one entry: the served model."""
        return JSONResponse({"object": "list", "data": [model_entry()]})

    @app.get("/v1/models/{model_id:path}", tags=["openai"])
    async def retrieve_model(model_id: str) -> JSONResponse:
        """OpenAI's retrieve-model: the served model by its id or an alias (answered under the
        served id); anything else is 404 ``model_not_found``."""
        state.check_model(model_id or "?")
        return JSONResponse(model_entry())

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> JSONResponse:
        """Liveness: 200 while the process serves HTTP."""
        return JSONResponse({"status": "ok"})

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> JSONResponse:
        """Readiness: 200 once the model is loaded and a warm-up ran, 503 before (or if it
        failed to load)."""
        if state.draining:
            err = NotReadyError("the server is shutting down")
            return JSONResponse(error_body(err), status_code=503)
        if state.ready:
            return JSONResponse({"status": "ready", "model": state.config.served_model_name})
        if state.load_error:
            err = NotReadyError(f"the model failed to load: {state.load_error}")
        else:
            err = NotReadyError("the model is still loading")
        return JSONResponse(error_body(err), status_code=503)

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        """Prometheus text exposition."""
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    from oasr_server.realtime import ROUTE, realtime_endpoint

    app.add_api_websocket_route(ROUTE, realtime_endpoint)

    @app.post("/v1/speech:recognize", tags=["oasr"])
    async def recognize(request: Request) -> JSONResponse:
        """Raw audio in the body (any container; or headerless PCM with ``encoding`` and
        ``sample_rate``); options in the query string (any other parameter is a decoding option,
        as the OpenAI routes' extra form fields); JSON result."""
        deadline = time.monotonic() + state.config.request_timeout
        engine, worker = state.require_ready()
        q = request.query_params
        state.check_model(q.get("model"))
        task = q.get("task") or "transcribe"
        if task not in ("transcribe", "translate"):
            raise InvalidRequestError(
                f"task must be transcribe or translate, not {task!r}", param="task"
            )
        words = _bool(q.get("word_timestamps"), "word_timestamps")
        options = _options(
            task=task,
            language=q.get("language") or None,
            prompt=q.get("prompt") or None,
            temperature=_float(q.get("temperature"), "temperature", 0.0, 1.0, 0.0),
            words=words,
            beam_size=_int(q.get("beam_size"), "beam_size", 1, 64, 1),
            extra={k: v for k, v in q.items() if k not in RECOGNIZE_PARAMS},
        )
        options.validate_for(engine.model)
        raw_format = None
        encoding = q.get("encoding")
        if encoding:
            from oasr.audio import RawPCMFormat

            rate = _int(q.get("sample_rate"), "sample_rate", 1, 10**7, None)
            if rate is None:
                raise InvalidRequestError(
                    "raw PCM (encoding=...) needs sample_rate", param="sample_rate"
                )
            raw_format = RawPCMFormat(
                sample_rate=rate,
                encoding=encoding,  # type: ignore[arg-type]
                channels=_int(q.get("channels"), "channels", 1, 64, 1) or 1,
            )
        data = await read_body(request, state.config.max_upload_bytes, state)
        route = "/v1/speech:recognize"
        audio = await state.decode(data, engine.sample_rate, route, raw_format)
        t = await state.transcribe(worker, audio, options, deadline, request.is_disconnected)
        return JSONResponse(
            {
                "model": state.config.served_model_name,
                "text": t.text,
                "language": t.language,
                "duration": round(t.duration, 3),
                "task": t.task,
                "segments": [
                    {
                        "id": s.id,
                        "start": round(s.start, 3),
                        "end": round(s.end, 3),
                        "text": s.text,
                        "confidence": s.confidence,
                        "no_speech_prob": s.no_speech_prob,
                    }
                    for s in t.segments
                ],
                "words": [
                    {
                        "word": w.word,
                        "start": round(w.start, 3),
                        "end": round(w.end, 3),
                        "confidence": w.confidence,
                    }
                    for w in t.words
                ],
            }
        )

"""``OASRClient``: a small, dependency-free client for an ``oasr-server`` (or any server that
speaks OpenAI's audio API). Uses only the standard library so ``oasr-core`` stays light.

    client = OASRClient("http://127.0.0.1:8000", api_key="...")
    body = client.transcribe("speech.flac", response_format="verbose_json")

``model`` is left out of a request unless given: a server then uses the one model it serves
(``oasr-server`` serves one model, under its ``--served-model-name`` and aliases).
"""

from __future__ import annotations

import json
import mimetypes
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from oasr.errors import (
    AudioTooLongError,
    EngineOverloadedError,
    InvalidRequestError,
    OASRError,
    UnknownModelError,
    UnsupportedOptionError,
)

_BY_CODE: dict[str, type[OASRError]] = {
    cls.code: cls
    for cls in (AudioTooLongError, EngineOverloadedError, UnknownModelError, UnsupportedOptionError)
}


class ServerError(OASRError):
    """The server answered with an error; ``http_status`` and ``code`` are the server's."""


def _multipart(fields: Iterable[tuple[str, str]], file_field: str, filename: str, data: bytes) -> tuple[bytes, str]:
    boundary = f"oasr-{uuid.uuid4().hex}"
    parts: list[bytes] = []
    for name, value in fields:
        parts.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        )
    ctype = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    parts.append(
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; '
            f'filename="{filename}"\r\nContent-Type: {ctype}\r\n\r\n'
        ).encode()
        + data
        + b"\r\n"
    )
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


class OASRClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: bytes | None = None, content_type: str | None = None) -> tuple[bytes, str]:
        req = urllib.request.Request(self.base_url + path, data=body, method=method)
        if content_type:
            req.add_header("Content-Type", content_type)
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read(), resp.headers.get("Content-Type", "")
        except urllib.error.HTTPError as exc:
            raise self._error(exc.code, exc.read()) from None
        except urllib.error.URLError as exc:
            raise ServerError(f"cannot reach {self.base_url}: {exc.reason}") from None

    @staticmethod
    def _error(status: int, raw: bytes) -> OASRError:
        try:
            err = json.loads(raw)["error"]
            message, code, param = err.get("message", ""), err.get("code"), err.get("param")
        except (ValueError, KeyError, TypeError):
            message, code, param = raw.decode("utf-8", "replace")[:500], None, None
        cls = _BY_CODE.get(code or "")
        if cls is None:
            cls = InvalidRequestError if status in (400, 404, 413, 422) else ServerError
        error = cls(f"server answered {status}: {message}", param=param)
        error.http_status = status
        if code:
            error.code = code
        return error

    @staticmethod
    def _option_fields(options: Mapping[str, Any] | None) -> list[tuple[str, str]]:
        """Decoding options as form fields, in the text the server parses back."""
        fields = []
        for name, value in (options or {}).items():
            if value is None:
                text = "none"
            elif isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, (list, tuple)):
                text = json.dumps(list(value), ensure_ascii=False)
            else:
                text = str(value)
            fields.append((name, text))
        return fields

    def _audio(self, route: str, file: str | Path | bytes, filename: str | None,
               options: Mapping[str, Any] | None = None, **form: Any) -> Any:
        if isinstance(file, (str, Path)):
            data, filename = Path(file).read_bytes(), filename or Path(file).name
        else:
            data, filename = file, filename or "audio"
        fields: list[tuple[str, str]] = []
        for key, value in form.items():
            if value is None:
                continue
            if key == "timestamp_granularities":
                fields.extend(("timestamp_granularities[]", str(v)) for v in value)
            else:
                fields.append((key, str(value)))
        fields.extend(self._option_fields(options))
        body, ctype = _multipart(fields, "file", filename, data)
        raw, rtype = self._request("POST", route, body, ctype)
        return json.loads(raw) if rtype.startswith("application/json") else raw.decode("utf-8")

    def transcribe(
        self,
        file: str | Path | bytes,
        *,
        model: str | None = None,
        language: str | None = None,
        prompt: str | None = None,
        response_format: str = "json",
        temperature: float | None = None,
        timestamp_granularities: list[str] | None = None,
        filename: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Any:
        """POST /v1/audio/transcriptions. JSON formats return a dict, the others text.
        ``model``: the served model's name (None: not sent; the server's model).

        ``options``: more decoding options by name, sent as form fields (an OASR extension):
        common ones without a parameter here (``beam_size``, ``max_new_tokens``, ``hotwords``)
        and the served family's (``{"no_speech_threshold": None, "long_form": "vad"}``); the
        server answers 400 naming an option its model does not understand."""
        return self._audio(
            "/v1/audio/transcriptions", file, filename, options, model=model, language=language,
            prompt=prompt, response_format=response_format, temperature=temperature,
            timestamp_granularities=timestamp_granularities,
        )

    def translate(
        self,
        file: str | Path | bytes,
        *,
        model: str | None = None,
        prompt: str | None = None,
        response_format: str = "json",
        temperature: float | None = None,
        filename: str | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> Any:
        """POST /v1/audio/translations; ``options`` as for :meth:`transcribe`."""
        return self._audio(
            "/v1/audio/translations", file, filename, options, model=model, prompt=prompt,
            response_format=response_format, temperature=temperature,
        )

    def models(self) -> list[dict[str, Any]]:
        raw, _ = self._request("GET", "/v1/models")
        return json.loads(raw)["data"]

    def ready(self) -> bool:
        try:
            self._request("GET", "/readyz")
        except OASRError:
            return False
        return True

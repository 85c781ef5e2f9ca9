"""Server-side typed errors and the OpenAI error body every failure is answered with."""

from __future__ import annotations

from typing import Any

from oasr.errors import EngineOverloadedError, InvalidRequestError, OASRError

__all__ = [
    "AuthenticationError",
    "ClientDisconnectedError",
    "EngineFailureError",
    "EngineOverloadedError",
    "NotFoundError",
    "NotReadyError",
    "OriginNotAllowedError",
    "RequestTimeoutError",
    "TooManyStreamsError",
    "VADUnavailableError",
    "UploadTimeoutError",
    "UploadTooLargeError",
    "UploadsBusyError",
    "error_body",
]


class UploadTooLargeError(InvalidRequestError):
    """The request body is larger than ``--max-upload-bytes``."""

    http_status = 413
    code = "upload_too_large"


class AuthenticationError(OASRError):
    """Missing or wrong bearer token."""

    http_status = 401
    code = "invalid_api_key"
    error_type = "invalid_request_error"


class OriginNotAllowedError(OASRError):
    """A browser request (``Origin`` header) from an origin not in ``--allowed-origin``."""

    http_status = 403
    code = "origin_not_allowed"
    error_type = "invalid_request_error"


class UploadTimeoutError(InvalidRequestError):
    """An upload stalled (``--upload-idle-timeout``) or crawled (``--upload-min-rate``)."""

    http_status = 408
    code = "upload_timeout"


class UploadsBusyError(EngineOverloadedError):
    """``--max-receiving-bytes`` of uploads are being received already."""


class AudioBacklogError(EngineOverloadedError):
    """``--max-pending-audio-seconds`` of decoded uploads are held already."""


class NotFoundError(InvalidRequestError):
    http_status = 404
    code = "not_found"


class MethodNotAllowedError(InvalidRequestError):
    http_status = 405
    code = "method_not_allowed"


class NotReadyError(OASRError):
    """The model is still loading (or failed to load)."""

    http_status = 503
    code = "model_not_ready"
    error_type = "server_error"


class RequestTimeoutError(OASRError):
    """The request was not answered within ``--request-timeout``."""

    http_status = 504
    code = "timeout"
    error_type = "server_error"


class ClientDisconnectedError(OASRError):
    """The client went away before its answer was ready (nginx's 499; nobody reads it)."""

    http_status = 499
    code = "client_closed_request"
    error_type = "invalid_request_error"


class EngineFailureError(OASRError):
    """The model raised something unexpected on this request (a bug, not the caller's fault)."""

    http_status = 500
    code = "engine_error"
    error_type = "server_error"


class TooManyStreamsError(EngineOverloadedError):
    """``--max-streams`` live streams are already open. The same "busy" answer as a full queue
    (503 ``overloaded`` with ``Retry-After``; WebSocket close 1013, gRPC ``UNAVAILABLE``): a
    client needs one rule for "try again shortly", whichever limit it hit."""


class VADUnavailableError(InvalidRequestError):
    """Server VAD / ``chunking_strategy`` asked for, but no VAD plugin is installed."""

    code = "vad_unavailable"


def error_body(error: OASRError) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": error.message,
            "type": error.error_type,
            "param": error.param,
            "code": error.code,
        }
    }

"""Typed errors. Each carries a message a user can act on.

Library calls raise these; the CLI prints ``str(error)`` without a traceback and the server maps
``http_status`` / ``code`` onto its error bodies, so a client always learns what to change.
"""

from __future__ import annotations


class OASRError(Exception):
    """Base class for every error OASR raises on purpose."""

    #: HTTP status a server should answer with.
    http_status: int = 500
    #: Stable machine-readable code (OpenAI error bodies carry it as ``code``).
    code: str = "internal_error"
    #: OpenAI-style error ``type``.
    error_type: str = "server_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(OASRError):
    """The caller asked for something malformed; fixing the request fixes it."""

    http_status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class UnknownModelError(InvalidRequestError):
    """No architecture, checkpoint or format matches what was asked for."""

    http_status = 404
    code = "model_not_found"


class MissingPluginError(UnknownModelError):
    """A registry key is known to belong to a distribution that is not installed."""

    code = "missing_plugin"

    def __init__(self, axis: str, key: str, distribution: str | None) -> None:
        if distribution:
            from oasr.defaults import install_hint  # (defaults imports this module)

            hint = f"install it with: {install_hint(distribution)}"
        else:
            hint = "no installed or known plugin provides it (see `oasr plugins`)"
        super().__init__(f"no plugin provides {axis} {key!r}; {hint}")
        self.axis = axis
        self.key = key
        self.distribution = distribution


class DuplicateRegistrationError(OASRError):
    """Two distributions claimed the same registry key; uninstall one of them."""

    code = "duplicate_plugin"

    def __init__(self, axis: str, key: str, first: str, second: str) -> None:
        super().__init__(
            f"{axis} {key!r} is registered by both {first!r} and {second!r}; "
            f"uninstall one of them or block one with OASR_DISABLE_PLUGINS"
        )
        self.axis = axis
        self.key = key
        self.distributions = (first, second)


class PluginLoadError(OASRError):
    """An installed plugin failed to import or to register."""

    code = "plugin_load_failed"

    def __init__(self, distribution: str, cause: BaseException, *, needed_for: str | None = None) -> None:
        # ``needed_for`` names what was asked for when the failure is why it is missing
        prefix = f"{needed_for} is not available: " if needed_for else ""
        super().__init__(
            f"{prefix}plugin distribution {distribution!r} failed to load: "
            f"{type(cause).__name__}: {cause}; reinstall it, or skip it with "
            f"OASR_DISABLE_PLUGINS={distribution}"
        )
        self.distribution = distribution
        self.cause = cause
        self.__cause__ = cause


class BadAudioError(InvalidRequestError):
    """The audio could not be decoded or is not usable (empty, truncated, not audio)."""

    code = "bad_audio"


class AudioTooLongError(InvalidRequestError):
    """The audio is longer than the configured limit."""

    http_status = 413
    code = "audio_too_long"


class UnsupportedOptionError(InvalidRequestError):
    """The option is valid in general but this model family cannot honour it."""

    code = "unsupported_option"


class CheckpointError(OASRError):
    """A checkpoint was found but is incomplete or inconsistent."""

    http_status = 500
    code = "bad_checkpoint"


class EngineOverloadedError(OASRError):
    """Too many requests are already waiting (the server's or the engine's queue is full); retry
    after a short pause. One error for every "queue full": HTTP 503 (the service is overloaded,
    as OpenAI answers for an overloaded engine; 429 would say this client exceeded its own rate)
    with ``Retry-After``, gRPC ``UNAVAILABLE``."""

    http_status = 503
    code = "overloaded"
    error_type = "server_error"


#: the scheduler's former name for the same error (``from oasr.scheduler import EngineBusyError``)
EngineBusyError = EngineOverloadedError

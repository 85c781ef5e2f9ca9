"""OASR: Open Automatic Speech Recognition.

``import oasr`` is cheap: the public API below is resolved lazily on first attribute access, and
nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from oasr._version import __version__
from oasr.hookspecs import hookimpl

if TYPE_CHECKING:
    from oasr.engine import ASREngine
    from oasr.types import (
        DecodeFamily,
        DecodingOptions,
        EngineConfig,
        FeatureSpec,
        ModelCapabilities,
        Segment,
        TokenizerSpec,
        Transcript,
        Word,
    )

_LAZY: dict[str, str] = {
    "ASREngine": "oasr.engine",
    "DecodeFamily": "oasr.types",
    "DecodingOptions": "oasr.types",
    "EngineConfig": "oasr.types",
    "FeatureSpec": "oasr.types",
    "ModelCapabilities": "oasr.types",
    "Segment": "oasr.types",
    "TokenizerSpec": "oasr.types",
    "Transcript": "oasr.types",
    "Word": "oasr.types",
    "errors": "oasr.errors",
}

__all__ = [
    "ASREngine",
    "DecodeFamily",
    "DecodingOptions",
    "EngineConfig",
    "FeatureSpec",
    "ModelCapabilities",
    "Segment",
    "TokenizerSpec",
    "Transcript",
    "Word",
    "__version__",
    "errors",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'oasr' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name == "errors" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

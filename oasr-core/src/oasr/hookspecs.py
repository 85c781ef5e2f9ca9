"""pluggy hook specifications: one ``register_*`` hook per registry axis.

Each hook receives a ``register`` callback. Call it once per item with a registry key, a
``"module:Class"`` string (imported only when the key is resolved) and optional metadata. A hook
module must not import torch or any heavy dependency at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

hookspec = pluggy.HookspecMarker("oasr")
hookimpl = pluggy.HookimplMarker("oasr")

Register = Callable[..., None]


@hookspec
def register_architectures(register: Register) -> None:
    """Register model architectures. Metadata: decode_family, offline, streaming,
    word_timestamps, source_formats, description."""


@hookspec
def register_checkpoint_formats(register: Register) -> None:
    """Register checkpoint formats (detect + load). Metadata: architecture, priority."""


@hookspec
def register_decoders(register: Register) -> None:
    """Register decoders. Metadata: decode_family."""


@hookspec
def register_tokenizers(register: Register) -> None:
    """Register tokenizers."""


@hookspec
def register_feature_extractors(register: Register) -> None:
    """Register feature frontends keyed by ``FeatureSpec.kind``."""


@hookspec
def register_vad_detectors(register: Register) -> None:
    """Register voice-activity detectors."""


@hookspec
def register_kernel_providers(register: Register) -> None:
    """Register kernel providers that replace ``oasr.layers`` ops on some device."""


@hookspec
def register_commands(cli: Any) -> None:
    """Add sub-commands to the ``oasr`` Typer app (``cli`` is the ``typer.Typer``)."""

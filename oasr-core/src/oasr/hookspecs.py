"""pluggy hook specifications: one ``register_*`` hook per registry axis.

Each hook receives a ``register`` callback. Call it once per item as
``register(key, "module:Attr", *, aliases=(), **metadata)``: a registry key, a ``"module:Attr"``
string (imported only when the key is resolved), older names that resolve to the same item, and
metadata. A hook module must not import torch or any heavy dependency at module level.

Every hook and every metadata key OASR reads is documented in ``docs/plugins.md`` (a test checks).
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
    """Register model architectures. Metadata: capabilities (a ModelCapabilities, the same
    constant the model class uses), source_formats, description."""


@hookspec
def register_checkpoint_formats(register: Register) -> None:
    """Register checkpoint formats (detect + load). Metadata: architecture, priority, description."""


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
    """Register kernel providers that replace ``oasr.layers`` ops on some device. Metadata:
    device_types, ops, description."""


@hookspec
def register_commands(cli: Any) -> None:
    """Add sub-commands to the ``oasr`` Typer app (``cli`` is the ``typer.Typer``)."""

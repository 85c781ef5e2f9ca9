"""Registries of lazy specs, one per axis.

A :class:`LazySpec` is a key, a ``"module:attr"`` target and metadata. Nothing is imported until
:meth:`LazySpec.load` runs, so listing every model never touches torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from oasr.errors import DuplicateRegistrationError, MissingPluginError, PluginLoadError

#: axis name -> hook that fills it
AXES: dict[str, str] = {
    "architecture": "register_architectures",
    "checkpoint_format": "register_checkpoint_formats",
    "decoder": "register_decoders",
    "tokenizer": "register_tokenizers",
    "feature_extractor": "register_feature_extractors",
    "vad_detector": "register_vad_detectors",
    "kernel_provider": "register_kernel_providers",
}


@dataclass(frozen=True)
class LazySpec:
    axis: str
    key: str
    target: str  # "package.module:Attr"
    distribution: str
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        module, sep, attr = self.target.partition(":")
        if not (module and sep and attr):
            raise ValueError(
                f"{self.distribution}: target for {self.axis} {self.key!r} must look like "
                f"'package.module:Attr', got {self.target!r}"
            )

    def load(self) -> Any:
        """Import the target. An import failure is a :class:`PluginLoadError` naming the
        distribution, so the user knows what to reinstall."""
        module_name, _, attr = self.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # noqa: BLE001 - any import-time failure is the plugin's
            raise PluginLoadError(self.distribution, exc) from exc
        return obj


# Known first-party plugins: lets `oasr models` list families that are not installed and lets a
# missing key name the distribution to install. Installed plugins' own metadata wins over this.
KNOWN_PLUGINS: dict[str, dict[str, dict[str, Any]]] = {
    "architecture": {
        "whisper": {
            "distribution": "oasr-models-whisper",
            "decode_family": "aed",
            "offline": True,
            "streaming": False,
            "source_formats": ["hf", "ctranslate2", "openai-whisper", "oasr"],
        },
        "wenet_conformer": {
            "distribution": "oasr-models-wenet",
            "decode_family": "ctc",
            "offline": True,
            "streaming": True,
            "source_formats": ["wenet", "oasr"],
        },
        "zipformer_ctc": {
            "distribution": "oasr-models-icefall",
            "decode_family": "ctc",
            "offline": True,
            "streaming": True,
            "source_formats": ["icefall", "oasr"],
        },
        "zipformer_transducer": {
            "distribution": "oasr-models-icefall",
            "decode_family": "transducer",
            "offline": True,
            "streaming": True,
            "source_formats": ["icefall", "oasr"],
        },
        "paraformer": {
            "distribution": "oasr-models-funasr",
            "decode_family": "cif",
            "offline": True,
            "streaming": False,
            "source_formats": ["funasr", "oasr"],
        },
        "qwen2_audio": {
            "distribution": "oasr-models-qwen",
            "decode_family": "llm",
            "offline": True,
            "streaming": False,
            "source_formats": ["hf", "oasr"],
        },
        "fastconformer_rnnt": {
            "distribution": "oasr-models-nemo",
            "decode_family": "transducer",
            "offline": True,
            "streaming": True,
            "source_formats": ["hf", "oasr"],
        },
    },
    "vad_detector": {"silero": {"distribution": "oasr-vad-silero"}},
    "kernel_provider": {"cuda": {"distribution": "oasr-kernels"}},
}


class Registry:
    """All specs registered for one axis."""

    def __init__(self, axis: str) -> None:
        self.axis = axis
        self._specs: dict[str, LazySpec] = {}

    def add(self, spec: LazySpec) -> None:
        existing = self._specs.get(spec.key)
        if existing is not None:
            raise DuplicateRegistrationError(
                self.axis, spec.key, existing.distribution, spec.distribution
            )
        self._specs[spec.key] = spec

    def get(self, key: str) -> LazySpec:
        try:
            return self._specs[key]
        except KeyError:
            known = KNOWN_PLUGINS.get(self.axis, {}).get(key, {})
            raise MissingPluginError(
                self.axis.replace("_", " "), key, known.get("distribution")
            ) from None

    def resolve(self, key: str) -> Any:
        return self.get(key).load()

    def __contains__(self, key: object) -> bool:
        return key in self._specs

    def __iter__(self) -> Iterator[LazySpec]:
        return iter(sorted(self._specs.values(), key=lambda s: s.key))

    def __len__(self) -> int:
        return len(self._specs)

    def keys(self) -> list[str]:
        return sorted(self._specs)

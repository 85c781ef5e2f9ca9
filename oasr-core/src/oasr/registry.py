"""Registries of lazy specs, one per axis.

A :class:`LazySpec` is a key, a ``"module:attr"`` target and metadata. Nothing is imported until
:meth:`LazySpec.load` runs, so listing every model never touches torch.

A spec may carry *aliases* (older names of the same key): looking an alias up gives the same spec.
Architecture specs carry their :class:`~oasr.types.ModelCapabilities` under ``capabilities``; the
model class reads the same constant, so what ``oasr models`` lists and what the model does cannot
disagree.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from oasr.errors import DuplicateRegistrationError, MissingPluginError, PluginLoadError
from oasr.types import DecodeFamily, ModelCapabilities

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

#: ``ModelCapabilities`` fields; an architecture may also give them as separate keywords
CAPABILITY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(ModelCapabilities))


def _pep503(name: str) -> str:
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


@dataclass(frozen=True)
class LazySpec:
    axis: str
    key: str
    target: str  # "package.module:Attr"
    distribution: str
    metadata: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: older names that resolve to this spec
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        module, sep, attr = self.target.partition(":")
        if not (module and sep and attr):
            raise ValueError(
                f"{self.distribution}: target for {self.axis} {self.key!r} must look like "
                f"'package.module:Attr', got {self.target!r}"
            )

    @property
    def capabilities(self) -> ModelCapabilities | None:
        """An architecture's declared capabilities (None on other axes)."""
        return self.metadata.get("capabilities")

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


def capabilities_from(value: ModelCapabilities | Mapping[str, Any]) -> ModelCapabilities:
    """A :class:`ModelCapabilities` from itself or from its fields as a mapping (the
    ``decode_family`` as a :class:`DecodeFamily` or its string value)."""
    if isinstance(value, ModelCapabilities):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"capabilities must be a ModelCapabilities or a dict, not {type(value).__name__}")
    unknown = sorted(set(value) - set(CAPABILITY_FIELDS))
    if unknown:
        raise TypeError(f"unknown capabilities {unknown}; known: {', '.join(CAPABILITY_FIELDS)}")
    fields = dict(value)
    if "decode_family" not in fields:
        raise TypeError("capabilities need a decode_family")
    fields["decode_family"] = DecodeFamily(fields["decode_family"])
    return ModelCapabilities(**fields)


def architecture_metadata(meta: Mapping[str, Any]) -> dict[str, Any]:
    """An architecture's registration metadata with its capabilities in one place: either
    ``capabilities=ModelCapabilities(...)`` (or its dict), or the capability fields given as
    separate keywords (``decode_family="ctc", streaming=True``), folded into one
    ``ModelCapabilities``. Giving both is an error: they could disagree."""
    out = {k: v for k, v in meta.items() if k not in CAPABILITY_FIELDS}
    loose = {k: v for k, v in meta.items() if k in CAPABILITY_FIELDS}
    if "capabilities" in out:
        if loose:
            raise TypeError(
                f"give capabilities once: capabilities=... and also {sorted(loose)} as keywords"
            )
        out["capabilities"] = capabilities_from(out["capabilities"])
    elif loose:
        out["capabilities"] = capabilities_from(loose)
    else:
        raise TypeError("an architecture needs capabilities=ModelCapabilities(decode_family=...)")
    return out


@dataclass(frozen=True)
class KnownPlugin:
    """A first-party key: enough to name the distribution to install when it is missing."""

    distribution: str
    aliases: tuple[str, ...] = ()
    description: str = ""


# First-party keys and the distributions that provide them, so that `oasr models` can list
# families that are not installed and a missing key (or one of its aliases) names the pip line.
# What an architecture can do is declared only by its plugin (``capabilities``), never here.
KNOWN_PLUGINS: dict[str, dict[str, KnownPlugin]] = {
    "architecture": {
        "conformer": KnownPlugin(
            "oasr-models-wenet", ("wenet_conformer",), "WeNet Conformer U2/U2++ (CTC + attention rescoring)"
        ),
        "zipformer": KnownPlugin("oasr-models-icefall", ("zipformer_ctc",), "icefall Zipformer (CTC)"),
        "transducer": KnownPlugin(
            "oasr-models-icefall", ("zipformer_transducer",), "icefall transducer (RNN-T)"
        ),
        "nemotron": KnownPlugin(
            "oasr-models-nemo", ("fastconformer_rnnt",), "NeMo FastConformer / Parakeet (CTC, RNN-T, TDT)"
        ),
        "whisper": KnownPlugin("oasr-models-whisper", (), "OpenAI Whisper"),
        "paraformer": KnownPlugin("oasr-models-funasr", (), "FunASR Paraformer (CIF)"),
        "speech_llm": KnownPlugin("oasr-models-qwen", ("qwen2_audio",), "Qwen2-Audio speech LLM"),
    },
    "vad_detector": {"silero": KnownPlugin("oasr-vad-silero", (), "Silero VAD")},
    "kernel_provider": {"cuda": KnownPlugin("oasr-kernels", (), "CUDA kernels")},
    "decoder": {"wfst": KnownPlugin("oasr-decoders-wfst", (), "WFST (TLG) graph search for CTC models")},
}


def known_plugin(axis: str, key: str) -> tuple[str, KnownPlugin] | None:
    """The first-party (canonical key, entry) that ``key`` or one of its aliases names."""
    for canonical, known in KNOWN_PLUGINS.get(axis, {}).items():
        if key == canonical or key in known.aliases:
            return canonical, known
    return None


class Registry:
    """All specs registered for one axis.

    ``failures`` returns the plugins that failed to load: a key that is missing because of one of
    them raises that :class:`PluginLoadError` (with what was asked for) instead of a plain
    :class:`MissingPluginError`; a key that is present never raises for an unrelated failure."""

    def __init__(
        self, axis: str, failures: Callable[[], Sequence[PluginLoadError]] = tuple
    ) -> None:
        self.axis = axis
        self._specs: dict[str, LazySpec] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical key
        self._failures = failures

    def add(self, spec: LazySpec) -> None:
        for name in (spec.key, *spec.aliases):
            owner = self._owner(name)
            if owner is not None:
                raise DuplicateRegistrationError(
                    self.axis, name, owner.distribution, spec.distribution
                )
        self._specs[spec.key] = spec
        for alias in spec.aliases:
            self._aliases[alias] = spec.key

    def remove_distribution(self, distribution: str) -> None:
        """Forget every spec ``distribution`` registered (an in-memory plugin unregistered)."""
        for key in [k for k, s in self._specs.items() if s.distribution == distribution]:
            spec = self._specs.pop(key)
            for alias in spec.aliases:
                self._aliases.pop(alias, None)

    def _owner(self, name: str) -> LazySpec | None:
        key = self._aliases.get(name, name)
        return self._specs.get(key)

    def canonical(self, key: str) -> str:
        """The canonical key for ``key`` (itself unless it is an alias of an installed or a
        first-party spec)."""
        if key in self._aliases:
            return self._aliases[key]
        if key in self._specs:
            return key
        known = known_plugin(self.axis, key)
        return known[0] if known is not None else key

    def get(self, key: str) -> LazySpec:
        spec = self._owner(key)
        if spec is not None:
            return spec
        failures = list(self._failures())
        what = f"{self.axis.replace('_', ' ')} {key!r}"
        known = known_plugin(self.axis, key)
        if known is not None:
            # we know who provides it: blame that distribution only if it is the one that failed
            provider = _pep503(known[1].distribution)
            for failure in failures:
                if _pep503(failure.distribution) == provider:
                    raise PluginLoadError(failure.distribution, failure.cause, needed_for=what)
            raise MissingPluginError(self.axis.replace("_", " "), key, known[1].distribution)
        if failures:
            # an unknown key may well be what a broken plugin would have registered
            first = failures[0]
            raise PluginLoadError(first.distribution, first.cause, needed_for=what)
        raise MissingPluginError(self.axis.replace("_", " "), key, None)

    def resolve(self, key: str) -> Any:
        return self.get(key).load()

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._owner(key) is not None

    def __iter__(self) -> Iterator[LazySpec]:
        return iter(sorted(self._specs.values(), key=lambda s: s.key))

    def __len__(self) -> int:
        return len(self._specs)

    def keys(self) -> list[str]:
        """Canonical keys (aliases are not listed; see :meth:`aliases`)."""
        return sorted(self._specs)

    def aliases(self) -> dict[str, str]:
        """alias -> canonical key."""
        return dict(self._aliases)

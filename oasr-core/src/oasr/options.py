"""Family options: what one model family understands beyond :class:`~oasr.types.DecodingOptions`.

:class:`~oasr.types.DecodingOptions` holds the options every family understands (beam size,
language, task, prompt, temperature, word timestamps, hotwords, max new tokens). Everything else a
request sets travels by name in ``DecodingOptions.model_options`` and is understood by the family
that serves the request. A family declares its options once, as a frozen dataclass that
subclasses :class:`ModelOptions`, one field per option written with :func:`option` (default,
bounds, one line of documentation)::

    @dataclass(frozen=True)
    class BeamOptions(ModelOptions):
        family = "toy"
        patience: float | None = option(None, gt=0, doc="beam search stops after ...")

The model exposes an instance as ``default_options`` (its defaults; a checkpoint may change
them). This module does the generic part for every family: values given as strings (CLI, HTTP
form fields, gRPC maps) are parsed into the declared types, bounds are checked, and a name the
family does not declare is an :class:`~oasr.errors.UnsupportedOptionError` that lists the valid
names. :func:`resolve_options` gives a request's :class:`ResolvedOptions`: the common and the
family options read as attributes of one object, so a family's decoding code reads
``options.beam_size`` and ``options.patience`` alike.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar, Union

from oasr.errors import InvalidRequestError, UnsupportedOptionError

__all__ = [
    "ModelOptions",
    "OptionSpec",
    "ResolvedOptions",
    "coerce_value",
    "option",
    "parse_assignments",
    "resolve_options",
]

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null", ""})

M = TypeVar("M", bound="ModelOptions")


def option(
    default: Any,
    *,
    doc: str,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Any:
    """One declared option of a :class:`ModelOptions` dataclass: its default, inclusive
    (``ge``/``le``) or exclusive (``gt``/``lt``) numeric bounds, and its documentation."""
    return dataclasses.field(
        default=default, metadata={"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt}
    )


# -- values from any surface -----------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    words = {type(None): "none", bool: "true or false", int: "an integer", float: "a number",
             str: "a string"}  # fmt: skip
    return words.get(tp, getattr(tp, "__name__", str(tp)))


def _scalar(value: Any, tp: Any, name: str) -> Any:
    """``value`` as a ``tp`` (bool, int, float, str), parsing it when it is a string."""
    text = value.strip() if isinstance(value, str) else None
    if tp is bool:
        if isinstance(value, bool):
            return value
        if text is not None and text.lower() in _TRUE | _FALSE:
            return text.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if text is not None:
            try:
                return int(text)
            except ValueError:
                pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if text is not None:
            try:
                return float(text)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # a declared type this parser does not know is a bug in the declaration
        raise TypeError(f"option {name!r}: unsupported declared type {tp!r}")
    raise ValueError


def _list_items(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            parsed = json.loads(text)
            if isinstance(parsed, list):
                return parsed
        return [part.strip() for part in text.split(",") if part.strip()]
    raise ValueError


def _coerce(value: Any, tp: Any, name: str) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        key = value.strip() if isinstance(value, str) else value
        if key in choices:
            return key
        raise ValueError
    if origin in (Union, types.UnionType):
        members = typing.get_args(tp)
        if type(None) in members and (
            value is None or (isinstance(value, str) and value.strip().lower() in _NONE)
        ):
            return None
        for member in (m for m in members if m is not type(None)):
            try:
                return _coerce(value, member, name)
            except (ValueError, TypeError):
                continue
        raise ValueError
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        return tuple(_coerce(v, item, name) for v in _list_items(value))
    if value is None:
        raise ValueError
    return _scalar(value, tp, name)


def coerce_value(name: str, value: Any, tp: Any) -> Any:
    """``value`` converted to the declared type ``tp``; strings (from the CLI, HTTP form fields
    or gRPC maps) are parsed: ``true``/``false``, numbers, ``none``/``null`` for an optional
    value, comma-separated or JSON lists. Raises :class:`InvalidRequestError` naming ``name``."""
    try:
        return _coerce(value, tp, name)
    except (ValueError, TypeError, json.JSONDecodeError):
        raise InvalidRequestError(
            f"{name} must be {_type_name(tp)}, not {value!r}", param=name
        ) from None


def parse_assignments(items: Iterable[str], *, param: str = "option") -> dict[str, str]:
    """``["NAME=VALUE", ...]`` (the CLI's repeatable ``--option``) as a name -> text mapping."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            raise InvalidRequestError(
                f"{param} must look like NAME=VALUE (e.g. patience=2), not {item!r}", param=param
            )
        out[name] = value
    return out


# -- declared options ------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptionSpec:
    """One declared option: what :meth:`ModelOptions.specs` reports (and the docs list)."""

    name: str
    type: Any
    default: Any
    doc: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    @property
    def type_name(self) -> str:
        return _type_name(self.type)

    def parse(self, value: Any) -> Any:
        """``value`` in the declared type, inside the declared bounds."""
        out = coerce_value(self.name, value, self.type)
        if isinstance(out, (int, float)) and not isinstance(out, bool):
            for bound, ok, words in (
                (self.ge, lambda x, b: x >= b, "at least"),
                (self.gt, lambda x, b: x > b, "greater than"),
                (self.le, lambda x, b: x <= b, "at most"),
                (self.lt, lambda x, b: x < b, "less than"),
            ):
                if bound is not None and not ok(out, bound):
                    raise InvalidRequestError(
                        f"{self.name} must be {words} {bound:g}, not {out:g}", param=self.name
                    )
        return out


def _common_names() -> frozenset[str]:
    from oasr.types import DecodingOptions

    return frozenset(f.name for f in dataclasses.fields(DecodingOptions))


@functools.cache
def _specs(cls: type) -> dict[str, OptionSpec]:
    hints = typing.get_type_hints(cls)
    common = _common_names()
    out: dict[str, OptionSpec] = {}
    for f in dataclasses.fields(cls):
        if f.name in common:
            raise TypeError(
                f"{cls.__name__}.{f.name} repeats a DecodingOptions field; family options must "
                f"not shadow the common ones"
            )
        meta = f.metadata
        out[f.name] = OptionSpec(
            f.name, hints[f.name], f.default, meta.get("doc", ""),
            meta.get("ge"), meta.get("gt"), meta.get("le"), meta.get("lt"),
        )  # fmt: skip
    return out


@dataclass(frozen=True)
class ModelOptions:
    """Base of a family's options (see the module docstring). Instances are immutable and
    validated on construction: every field is parsed into its declared type and bounds, then
    :meth:`validate` checks what depends on several options."""

    #: the family's name in error messages ("whisper", "wenet")
    family: ClassVar[str] = "this model"

    def __post_init__(self) -> None:
        for name, spec in self.specs().items():
            object.__setattr__(self, name, spec.parse(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """Checks across options; a subclass raises :class:`InvalidRequestError` (``param``
        naming the option) for a combination it cannot honour."""

    @classmethod
    def specs(cls) -> dict[str, OptionSpec]:
        """The declared options by name, in declaration order."""
        return _specs(cls)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(cls.specs())

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.specs()}

    def override(self: M, values: Mapping[str, Any]) -> M:
        """A copy with ``values`` (name -> value or string) applied; an unknown name is an
        :class:`UnsupportedOptionError` listing the valid ones."""
        if not values:
            return self
        specs = self.specs()
        for name in values:
            if name not in specs:
                raise UnsupportedOptionError(unknown_option_message(name, self.family, specs), param=name)
        return dataclasses.replace(self, **dict(values))

    def with_saved(self: M, saved: Mapping[str, Any] | None) -> M:
        """These defaults with those a native checkpoint saved (its ``decoding``); names this
        version does not know (a newer writer added them) are skipped, not refused."""
        specs = self.specs()
        return self.override({k: v for k, v in (saved or {}).items() if k in specs})

    def resolve(self, options: Any) -> ResolvedOptions:
        """``options`` (:class:`~oasr.types.DecodingOptions`, or already resolved) with this
        family's options: these defaults overridden by ``options.model_options``."""
        if isinstance(options, ResolvedOptions):
            if type(options.family) is type(self):
                return options
            options = options.common
        family = self.override(options.model_options)
        # the request's values as parsed (2.0, not "2"): equal requests compare equal
        parsed = {name: getattr(family, name) for name in options.model_options}
        if parsed != options.model_options:
            options = dataclasses.replace(options, model_options=parsed)
        return ResolvedOptions(options, family)


def unknown_option_message(name: str, family: str, specs: Mapping[str, Any]) -> str:
    valid = ", ".join(specs) if specs else "none"
    return (
        f"{family} models have no option {name!r}; the options they understand are: {valid} "
        f"(and the common ones: {', '.join(sorted(_common_names() - {'model_options'}))})"
    )


class ResolvedOptions:
    """A request's :class:`~oasr.types.DecodingOptions` (``common``) with its family's options
    resolved (``family``, or None for a model that declares none). Both read as attributes:
    ``resolved.beam_size``, ``resolved.temperatures``, ``resolved.patience``."""

    __slots__ = ("common", "family", "_family_values")

    def __init__(self, common: Any, family: ModelOptions | None) -> None:
        self.common = common
        self.family = family
        # the family's values by name, read once: decoders read options in their inner loops,
        # and a dict lookup costs a fraction of asking the dataclass for its fields each time
        self._family_values = {n: getattr(family, n) for n in family.specs()} if family is not None else {}

    def __getattr__(self, name: str) -> Any:  # only names that are not slots reach here
        if name.startswith("__") or name in ResolvedOptions.__slots__:
            raise AttributeError(name)  # unset slots and protocol probes (copy, pickle)
        values = self._family_values
        if name in values:
            return values[name]
        return getattr(self.common, name)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ResolvedOptions):
            return NotImplemented
        return self.common == other.common and self.family == other.family

    __hash__ = None  # type: ignore[assignment]  # DecodingOptions is mutable, so is this view

    def __repr__(self) -> str:
        return f"ResolvedOptions({self.common!r}, {self.family!r})"

    def validate_for(self, model: Any) -> ResolvedOptions:
        """:meth:`DecodingOptions.validate_for`, without parsing the family options again when
        they were resolved for this model's family (the engine resolves once at submit; the
        executors and models check again per request or batch)."""
        self.common.check_supported(model.capabilities, model.name)
        return resolve_options(model, self)


def resolve_options(model: Any, options: Any) -> ResolvedOptions:
    """``options`` for ``model``: its ``default_options`` overridden by the request's
    ``model_options``. A model that declares no options refuses any."""
    from oasr.model import HasModelOptions

    defaults = model.default_options if isinstance(model, HasModelOptions) else None
    if isinstance(options, ResolvedOptions):
        if defaults is None and options.family is None:
            return options  # resolved already, for a model without options
        if defaults is None:
            options = options.common
        # else: defaults.resolve keeps options resolved for this family as they are
    if defaults is None:
        if options.model_options:
            names = sorted(options.model_options)
            raise UnsupportedOptionError(
                f"{getattr(model, 'name', 'this model')} takes no model options; remove "
                f"{', '.join(names)}",
                param=names[0],
            )
        return ResolvedOptions(options, None)
    return defaults.resolve(options)

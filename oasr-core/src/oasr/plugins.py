"""The plugin manager: discovers ``oasr`` entry points, runs their hooks, fills the registries.

One process-wide manager, loaded on first use. Core's built-ins go through the same hooks as
third-party plugins (they are registered under the distribution name ``oasr-core``).

Environment:
  ``OASR_PLUGINS``          comma-separated allow-list of distribution names; only these load.
  ``OASR_DISABLE_PLUGINS``  comma-separated block-list of distribution names.
Core's built-ins are always loaded.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType, ModuleType
from typing import Any

import pluggy

from oasr import hookspecs
from oasr.errors import PluginLoadError
from oasr.registry import AXES, LazySpec, Registry

ENTRY_POINT_GROUP = "oasr"
CORE_DISTRIBUTION = "oasr-core"


def normalize_name(name: str) -> str:
    """PEP 503 normalisation so 'OASR_Models.Whisper' and 'oasr-models-whisper' compare equal."""
    return "-".join(name.replace("_", "-").replace(".", "-").lower().split("-"))


def _env_set(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None:
        return None
    return {normalize_name(n) for n in raw.split(",") if n.strip()}


@dataclass
class PluginInfo:
    """What ``oasr plugins`` reports for one distribution."""

    distribution: str
    version: str
    module: str
    hooks: list[str] = field(default_factory=list)
    registered: dict[str, list[str]] = field(default_factory=dict)


class PluginManager:
    def __init__(self, group: str = ENTRY_POINT_GROUP) -> None:
        self.group = group
        self._pm = pluggy.PluginManager("oasr")
        self._pm.add_hookspecs(hookspecs)
        self.registries: dict[str, Registry] = {axis: Registry(axis) for axis in AXES}
        self.plugins: dict[str, PluginInfo] = {}
        #: plugins that failed to import or register; the CLI warns, library calls raise
        self.failures: list[PluginLoadError] = []
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading -----------------------------------------------------------------------------
    def load(self) -> None:
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            from oasr import _builtins

            self._add_plugin(CORE_DISTRIBUTION, _version_of(CORE_DISTRIBUTION), _builtins)
            allow = _env_set("OASR_PLUGINS")
            block = _env_set("OASR_DISABLE_PLUGINS") or set()
            seen: set[str] = set()
            for ep in metadata.entry_points(group=self.group):
                dist_name = ep.dist.name if ep.dist is not None else ep.name
                norm = normalize_name(dist_name)
                if norm == CORE_DISTRIBUTION or norm in seen:
                    continue  # core is registered directly; one module per distribution
                seen.add(norm)
                if norm in block or (allow is not None and norm not in allow):
                    continue
                try:
                    module = ep.load()
                except Exception as exc:  # noqa: BLE001 - report any failure, keep going
                    self.failures.append(PluginLoadError(dist_name, exc))
                    continue
                version = ep.dist.version if ep.dist is not None else "unknown"
                self._add_plugin(dist_name, version, module)
            self._pm.check_pending()

    def _add_plugin(self, dist_name: str, version: str, module: ModuleType) -> None:
        try:
            self._pm.register(module, name=dist_name)
        except Exception as exc:  # noqa: BLE001 - e.g. a hook that has no spec
            self.failures.append(PluginLoadError(dist_name, exc))
            return
        info = PluginInfo(dist_name, version, module.__name__)
        self.plugins[dist_name] = info
        info.hooks = sorted(
            name for name in dir(self._pm.hook) if not name.startswith("_")
            and any(i.plugin is module for i in getattr(self._pm.hook, name).get_hookimpls())
        )
        # Call each hook per plugin so every spec records the distribution that provided it.
        for axis, hook_name in AXES.items():
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin is not module:
                    continue
                try:
                    impl.function(register=self._registrar(axis, dist_name, info))
                except _Fatal as fatal:
                    raise fatal.error from None
                except Exception as exc:  # noqa: BLE001 - a plugin bug: record, keep going
                    self.failures.append(PluginLoadError(dist_name, exc))

    def _registrar(self, axis: str, dist_name: str, info: PluginInfo) -> Callable[..., None]:
        def register(key: str, target: str, **meta: Any) -> None:
            spec = LazySpec(axis, key, target, dist_name, MappingProxyType(dict(meta)))
            try:
                self.registries[axis].add(spec)
            except Exception as exc:
                # A duplicate key is the user's installation problem, not this plugin's bug:
                # surface it as-is, wherever it happens.
                raise _Fatal(exc) from exc
            info.registered.setdefault(axis, []).append(key)

        return register

    # -- access ------------------------------------------------------------------------------
    def registry(self, axis: str, *, strict: bool = True) -> Registry:
        """The registry for ``axis``. With ``strict`` (library default) a plugin that failed to
        load is raised here rather than silently missing."""
        self.load()
        if strict and self.failures:
            raise self.failures[0]
        return self.registries[axis]

    def add_commands(self, cli: Any) -> None:
        self.load()
        for impl in self._pm.hook.register_commands.get_hookimpls():
            try:
                impl.function(cli=cli)
            except Exception as exc:  # noqa: BLE001
                self.failures.append(PluginLoadError(impl.plugin_name, exc))


class _Fatal(Exception):
    """Wraps an error that must propagate out of plugin loading instead of being recorded."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


def _version_of(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        from oasr._version import __version__

        return __version__


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    global _manager
    with _manager_lock:
        if _manager is None:
            _manager = PluginManager()
        return _manager


def reset_plugin_manager() -> None:
    """Forget every loaded plugin (tests, or after changing OASR_PLUGINS at run time)."""
    global _manager
    with _manager_lock:
        _manager = None


def get_registry(axis: str, *, strict: bool = True) -> Registry:
    return get_plugin_manager().registry(axis, strict=strict)


def resolve(axis: str, key: str) -> Any:
    """Import and return what ``key`` names on ``axis``; raises a typed error if nothing does."""
    return get_registry(axis).resolve(key)

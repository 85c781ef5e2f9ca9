"""The plugin manager: discovers ``oasr`` entry points, runs their hooks, fills the registries.

One process-wide manager, loaded on first use. Core's built-ins go through the same hooks as
third-party plugins (they are registered under the distribution name ``oasr-core``).

A plugin that fails (its hook module does not import, a hook raises, it implements a hook OASR
does not define, it registers something malformed) is recorded in
:attr:`PluginManager.failures` and the others load. The CLI and the server warn about each
failure once and carry on; a library lookup raises the failure only when it is why the key asked
for is missing (:class:`oasr.registry.Registry`).

Environment:
  ``OASR_PLUGINS``          comma-separated allow-list of distribution names; only these load.
  ``OASR_DISABLE_PLUGINS``  comma-separated block-list of distribution names.
Core's built-ins are always loaded.

Tests (and applications) can add a plugin object or module without installing a distribution:
:meth:`PluginManager.register_plugin` / :func:`temporary_plugin`.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import metadata
from types import MappingProxyType
from typing import Any

import pluggy

from oasr import hookspecs
from oasr.errors import DuplicateRegistrationError, PluginLoadError
from oasr.registry import AXES, LazySpec, Registry, architecture_metadata

ENTRY_POINT_GROUP = "oasr"
CORE_DISTRIBUTION = "oasr-core"
#: version reported for a plugin registered in memory that has no ``__version__``
IN_MEMORY_VERSION = "in-memory"


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
        self.failures: list[PluginLoadError] = []
        self.registries: dict[str, Registry] = {
            axis: Registry(axis, failures=lambda: self.failures) for axis in AXES
        }
        self.plugins: dict[str, PluginInfo] = {}
        self._reported: set[int] = set()  # ids of failures already warned about
        #: two distributions claiming one key: raised by every access, not only the first
        self._conflict: DuplicateRegistrationError | None = None
        self._loaded = False
        self._lock = threading.RLock()

    # -- loading -----------------------------------------------------------------------------
    def load(self) -> None:
        with self._lock:
            if self._conflict is not None:
                raise self._conflict
            if self._loaded:
                return
            self._loaded = True
            try:
                self._load_all()
            except DuplicateRegistrationError as exc:
                self._conflict = exc
                raise

    def _load_all(self) -> None:
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

    def register_plugin(self, plugin: object | str, name: str, version: str | None = None) -> bool:
        """Add a plugin without an installed distribution: a module or object with hook
        implementations, or the name of a module to import (an import failure is recorded like
        an entry point's). ``name`` stands for the distribution in listings and errors. Returns
        whether it loaded; its failures are in :attr:`failures`. Undo with
        :meth:`unregister_plugin`."""
        with self._lock:
            self.load()
            if name in self.plugins or self._pm.has_plugin(name):
                raise ValueError(f"a plugin named {name!r} is already registered")
            if isinstance(plugin, str):
                try:
                    plugin = importlib.import_module(plugin)
                except Exception as exc:  # noqa: BLE001 - same as a failing entry point
                    self.failures.append(PluginLoadError(name, exc))
                    return False
            ver = version or str(getattr(plugin, "__version__", IN_MEMORY_VERSION))
            try:
                return self._add_plugin(name, ver, plugin)
            except BaseException:  # e.g. a duplicate key: leave nothing half-registered
                self.unregister_plugin(name)
                raise

    def unregister_plugin(self, name: str) -> None:
        """Remove what :meth:`register_plugin` added: the hooks, every spec the plugin
        registered and its recorded failures."""
        with self._lock:
            if self._pm.has_plugin(name):
                self._pm.unregister(name=name)
            self.plugins.pop(name, None)
            for registry in self.registries.values():
                registry.remove_distribution(name)
            self.failures[:] = [f for f in self.failures if f.distribution != name]

    def _add_plugin(self, dist_name: str, version: str, plugin: object) -> bool:
        try:
            self._pm.register(plugin, name=dist_name)
        except Exception as exc:  # noqa: BLE001 - e.g. a hook implementation with bad arguments
            self.failures.append(PluginLoadError(dist_name, exc))
            return False
        unknown = sorted(
            name for name in dir(self._pm.hook) if not name.startswith("_")
            and not getattr(self._pm.hook, name).has_spec()
            and any(i.plugin is plugin for i in getattr(self._pm.hook, name).get_hookimpls())
        )
        if unknown:  # a misspelt hook would otherwise never run, silently
            self._pm.unregister(plugin)
            known = ", ".join(sorted([*AXES.values(), "register_commands"]))
            self.failures.append(PluginLoadError(dist_name, TypeError(
                f"implements {', '.join(unknown)}, which OASR does not define (hooks: {known})"
            )))
            return False
        info = PluginInfo(dist_name, version, getattr(plugin, "__name__", type(plugin).__name__))
        self.plugins[dist_name] = info
        info.hooks = sorted(
            name for name in dir(self._pm.hook) if not name.startswith("_")
            and any(i.plugin is plugin for i in getattr(self._pm.hook, name).get_hookimpls())
        )
        ok = True
        # Call each hook per plugin so every spec records the distribution that provided it.
        for axis, hook_name in AXES.items():
            for impl in getattr(self._pm.hook, hook_name).get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                try:
                    impl.function(register=self._registrar(axis, dist_name, info))
                except _Fatal as fatal:
                    raise fatal.error from None
                except Exception as exc:  # noqa: BLE001 - a plugin bug: record, keep going
                    self.failures.append(PluginLoadError(dist_name, exc))
                    ok = False
        return ok

    def _registrar(self, axis: str, dist_name: str, info: PluginInfo) -> Callable[..., None]:
        def register(key: str, target: str, *, aliases: Any = (), **meta: Any) -> None:
            if isinstance(aliases, str):
                aliases = (aliases,)
            if axis == "architecture":
                try:
                    meta = architecture_metadata(meta)
                except (TypeError, ValueError) as exc:
                    raise TypeError(f"architecture {key!r}: {exc}") from exc
            spec = LazySpec(axis, key, target, dist_name, MappingProxyType(meta), tuple(aliases))
            try:
                self.registries[axis].add(spec)
            except Exception as exc:
                # A duplicate key is the user's installation problem, not this plugin's bug:
                # surface it as-is, wherever it happens.
                raise _Fatal(exc) from exc
            info.registered.setdefault(axis, []).append(key)

        return register

    # -- access ------------------------------------------------------------------------------
    def registry(self, axis: str) -> Registry:
        """The registry for ``axis``. Plugins that failed to load do not raise here: a lookup of
        a key that is missing because of one of them does (see :class:`Registry`)."""
        self.load()
        return self.registries[axis]

    def unreported_failures(self) -> list[PluginLoadError]:
        """Failures not yet returned by this method: the CLI and the server warn about each
        plugin failure once per process, whichever of them looks first."""
        with self._lock:
            self.load()
            fresh = [f for f in self.failures if id(f) not in self._reported]
            self._reported.update(id(f) for f in fresh)
            return fresh

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


@contextmanager
def temporary_plugin(plugin: object | str, name: str, version: str | None = None) -> Iterator[PluginManager]:
    """Register ``plugin`` (a module, an object with hook implementations, or a module name to
    import) on the process-wide manager for the ``with`` block, then remove it::

        class Toy:
            @hookimpl
            def register_architectures(self, register):
                register("toy", "toy_pkg.model:Toy", capabilities={"decode_family": "ctc"})

        with temporary_plugin(Toy(), name="oasr-toy"):
            assert "toy" in get_registry("architecture")
    """
    manager = get_plugin_manager()
    manager.register_plugin(plugin, name=name, version=version)
    try:
        yield manager
    finally:
        manager.unregister_plugin(name)


def get_registry(axis: str) -> Registry:
    return get_plugin_manager().registry(axis)


def resolve(axis: str, key: str) -> Any:
    """Import and return what ``key`` (or one of its aliases) names on ``axis``; raises a typed
    error if nothing does."""
    return get_registry(axis).resolve(key)

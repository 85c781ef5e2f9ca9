"""Activation of kernel providers: plugins that replace ``oasr.layers`` ops on a device type.

A plugin registers a provider on the ``kernel_provider`` axis::

    @hookimpl
    def register_kernel_providers(register):
        register("cuda", "oasr_kernels.provider:install", device_types=["cuda"])

The target is a callable ``install(device_type)`` that registers its overrides with
:func:`oasr.layers.register_override`. ``device_types`` (metadata) lists the device types it
serves; without it the registry key is the device type. :func:`install_kernel_providers` runs
every provider for one device type once per process; :func:`oasr.checkpoint.load_model` calls it
for the model's device. A provider whose import or installation fails is logged as a warning
naming its distribution, any overrides it registered before failing are removed, and the native
ops are used: a kernel set must never stop inference. ``OASR_DISABLE_OVERRIDES=1`` skips them all.

Torch-free: nothing is imported unless a provider for the device type is registered.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

from oasr.registry import LazySpec

__all__ = ["install_kernel_providers", "kernel_providers_for"]

log = logging.getLogger(__name__)

_LOCK = threading.Lock()
#: device type -> distributions whose providers are installed for it (present = done)
_INSTALLED: dict[str, list[str]] = {}


def _device_types(spec: LazySpec) -> tuple[str, ...]:
    types: Any = spec.metadata.get("device_types")
    if types is None:
        return (spec.key,)
    return (types,) if isinstance(types, str) else tuple(types)


def kernel_providers_for(device_type: str) -> list[LazySpec]:
    """The registered kernel provider specs serving ``device_type`` ("cuda", "cpu", ...)."""
    from oasr.plugins import get_registry

    # Listing never raises for a broken plugin: an unrelated failure must not keep kernels away.
    registry = get_registry("kernel_provider")
    return [spec for spec in registry if device_type in _device_types(spec)]


def _overrides_snapshot() -> dict | None:
    dispatch = sys.modules.get("oasr.layers._dispatch")
    return None if dispatch is None else dispatch.list_overrides()


def _restore_overrides(before: dict | None) -> None:
    dispatch = sys.modules.get("oasr.layers._dispatch")
    if dispatch is None:
        return
    before = before or {}
    for key, fn in dispatch.list_overrides().items():
        if before.get(key) is fn:
            continue
        if key in before:
            dispatch.register_override(*key, before[key])
        else:
            dispatch.unregister_override(*key)


def install_kernel_providers(device_type: str) -> list[str]:
    """Install every kernel provider registered for ``device_type`` (a device string such as
    ``"cuda:1"`` is reduced to its type), once per process. Returns the distributions whose
    providers are installed. Never raises for a provider's failure: it warns and skips it."""
    device_type = str(device_type).split(":", 1)[0]
    if os.environ.get("OASR_DISABLE_OVERRIDES", "") in ("1", "true", "yes"):
        return []
    with _LOCK:
        if device_type in _INSTALLED:
            return list(_INSTALLED[device_type])
        specs = kernel_providers_for(device_type)
        installed: list[str] = []
        _INSTALLED[device_type] = installed
        for spec in specs:
            before = _overrides_snapshot()
            try:
                spec.load()(device_type)
            except Exception as exc:  # noqa: BLE001 - a kernel set must never stop inference
                _restore_overrides(before)
                log.warning(
                    "kernel provider %r of %s was not installed for %s (%s: %s); "
                    "the native oasr.layers ops are used",
                    spec.key, spec.distribution, device_type, type(exc).__name__, exc,
                )  # fmt: skip
                continue
            installed.append(spec.distribution)
            log.debug("installed kernel provider %r of %s for %s", spec.key,
                      spec.distribution, device_type)  # fmt: skip
        return list(installed)


def _reset() -> None:
    """Forget which providers were installed (tests); does not remove their overrides."""
    with _LOCK:
        _INSTALLED.clear()

"""Per-device op overrides: the hook kernel providers use to replace an ``oasr.layers`` op.

An *op* has a name (``"linear"``, ``"layer_norm"``, ``"attention"``, ...) and a native
implementation in plain PyTorch. A provider calls::

    register_override("linear", "cuda", my_linear)

after which every ``oasr.layers.Linear`` whose input lives on a CUDA device calls
``my_linear(module, x)`` instead of ``module.forward_native(x)``. Module ops receive the module
first and then the forward arguments; functional ops (``"attention"``) receive exactly the
arguments of their native function. An override may return :data:`NotImplemented` to fall back to
the native implementation for inputs it does not handle (a dtype, a shape).

One override per (op, device type): registering a second one replaces the first and returns it.
Overrides are process-global; :func:`override` is a context manager for scoped use (tests,
benchmarks), and ``OASR_DISABLE_OVERRIDES=1`` (or :func:`set_overrides_enabled`) turns them all
off, which is how one checks a kernel against the native path.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

OverrideFn = Callable[..., Any]

_LOCK = threading.Lock()
_OVERRIDES: dict[tuple[str, str], OverrideFn] = {}
_ENABLED = [os.environ.get("OASR_DISABLE_OVERRIDES", "") not in ("1", "true", "yes")]

#: Ops defined by oasr.layers; overrides for other names are refused (catches typos).
KNOWN_OPS: set[str] = set()


def declare_op(name: str) -> str:
    """Declare an op name so it can be overridden (layers call this at import)."""
    KNOWN_OPS.add(name)
    return name


def register_override(op_name: str, device_type: str, fn: OverrideFn) -> OverrideFn | None:
    """Use ``fn`` for ``op_name`` on tensors of ``device_type`` ("cuda", "cpu", "mps", ...).
    Returns the override it replaced, if any."""
    if op_name not in KNOWN_OPS:
        known = ", ".join(sorted(KNOWN_OPS))
        raise KeyError(f"unknown oasr.layers op {op_name!r}; ops that can be overridden: {known}")
    if not callable(fn):
        raise TypeError(f"override for {op_name!r} must be callable, got {type(fn).__name__}")
    with _LOCK:
        previous = _OVERRIDES.get((op_name, device_type))
        _OVERRIDES[(op_name, device_type)] = fn
    return previous


def unregister_override(op_name: str, device_type: str) -> OverrideFn | None:
    """Remove the override of ``op_name`` on ``device_type``; returns it (None if there was none)."""
    with _LOCK:
        return _OVERRIDES.pop((op_name, device_type), None)


def get_override(op_name: str, device_type: str) -> OverrideFn | None:
    if not _ENABLED[0]:
        return None
    return _OVERRIDES.get((op_name, device_type))


def list_overrides() -> dict[tuple[str, str], OverrideFn]:
    """A snapshot of the registered overrides keyed by (op name, device type)."""
    with _LOCK:
        return dict(_OVERRIDES)


def set_overrides_enabled(enabled: bool) -> bool:
    """Globally enable/disable overrides (native ops only when False). Returns the old value."""
    old = _ENABLED[0]
    _ENABLED[0] = bool(enabled)
    return old


@contextlib.contextmanager
def native_ops() -> Iterator[None]:
    """Every overridable op runs its native code inside the ``with`` block (a reference run, or
    the other side of a kernel's A/B), whatever overrides are registered; restored after."""
    old = set_overrides_enabled(False)
    try:
        yield
    finally:
        set_overrides_enabled(old)


@contextlib.contextmanager
def override(op_name: str, device_type: str, fn: OverrideFn) -> Iterator[None]:
    """Register ``fn`` for the duration of a ``with`` block, then restore what was there."""
    previous = register_override(op_name, device_type, fn)
    try:
        yield
    finally:
        if previous is None:
            unregister_override(op_name, device_type)
        else:
            register_override(op_name, device_type, previous)


def call_op(op_name: str, device_type: str, native: OverrideFn, *args: Any, **kwargs: Any) -> Any:
    """Run ``op_name``'s override for ``device_type`` if one is registered and accepts the
    inputs, else ``native(*args, **kwargs)``."""
    fn = get_override(op_name, device_type) if _OVERRIDES else None
    if fn is not None:
        out = fn(*args, **kwargs)
        if out is not NotImplemented:
            return out
    return native(*args, **kwargs)

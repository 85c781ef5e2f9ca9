"""Auto-tuning of kernel launch parameters, and the JSON cache kernels read them from.

A kernel provider describes each tunable kernel as a :class:`Tunable` (its op, candidate launch
parameters per shape, a way to build inputs and launch with given parameters, the defaults) and
registers it with :func:`register_tunable`. :func:`autotune` times every candidate on the
running GPU (CUDA events, median of several launches), keeps the fastest per shape key, and
writes the winners to the cache file of this GPU:

    $OASR_AUTOTUNE_CACHE                                   (a file path, if set)
    $XDG_CACHE_HOME/oasr/autotune/<gpu-name>-sm<XY>.json   (XDG_CACHE_HOME defaults to ~/.cache)

A kernel calls :func:`tuned_params` at launch with its op, shape key and device; the first call
per device reads the file (a missing or unreadable file means defaults), later calls are one
dict lookup. A provider may ship entries measured on a reference GPU per architecture
(:func:`register_builtin`); the file's entries win over them. ``OASR_AUTOTUNE=0`` ignores both
(defaults only).

Nothing here imports torch at module import time (``import oasr`` stays light).
"""

from __future__ import annotations

import json
import logging
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "CACHE_VERSION", "Tunable", "autotune", "cache_path", "clear_memory_cache", "cuda_event_timer",
    "cuda_graph_timer", "device_identity", "register_builtin", "register_tunable", "registered_tunables",
    "tuned_params",
]  # fmt: skip

log = logging.getLogger(__name__)

CACHE_VERSION = 1
Params = dict[str, Any]
#: a timer takes a launch (a no-argument callable) and returns its time in seconds
Timer = Callable[[Callable[[], Any]], float]


@dataclass
class Tunable:
    """One kernel's search space.

    ``key(shape, dtype)``: the cache key of a shape (what the kernel computes at launch);
    ``candidates(shape)``: launch parameter dicts to try; ``make(shape, dtype, device)``: inputs
    for the shape, returning ``run(params)`` that launches once (``None`` from ``run``: the
    candidate cannot run and is skipped); ``default(shape)``: the parameters used without a
    cache entry; ``shapes``: the representative shapes :func:`autotune` uses when given none;
    ``variant``: tells apart tunables of one op (``"layer"``/``"rms"`` norms)."""

    op: str
    key: Callable[[dict, Any], str]
    candidates: Callable[[dict], list[Params]]
    make: Callable[[dict, Any, Any], Callable[[Params], Any]]
    default: Callable[[dict], Params]
    shapes: list[dict] = field(default_factory=list)
    variant: str = ""
    dtypes: Sequence[Any] | None = None  # None: float16, bfloat16, float32
    #: ``native(shape, dtype, device)`` -> a call of the op's native implementation on the same
    #: inputs: when given, the winner is also timed against it and stored with ``use_kernel``
    #: (False: the native op is faster for this key, and the override declines it)
    native: Callable[[dict, Any, Any], Callable[[], Any]] | None = None


_TUNABLES: list[Tunable] = []
_LOCK = threading.Lock()
_MEMORY: dict[str, dict[str, dict[str, Params]]] = {}  # device id -> op -> key -> params
#: entries shipped by kernel providers, measured on a reference GPU of that architecture:
#: arch -> op -> key -> params (a cache file's entry for the key wins over them)
_BUILTIN: dict[str, dict[str, dict[str, Params]]] = {}


def register_tunable(tunable: Tunable) -> None:
    """Make ``tunable`` known to :func:`autotune` (replaces one with the same op and variant)."""
    with _LOCK:
        _TUNABLES[:] = [t for t in _TUNABLES if (t.op, t.variant) != (tunable.op, tunable.variant)]
        _TUNABLES.append(tunable)


def register_builtin(arch: str, entries: dict[str, dict[str, Any]]) -> None:
    """Entries (``{op: {key: {"params": {...}} or {...}}}``) measured by a provider on a GPU of
    architecture ``arch`` ("sm90"): used for keys the cache file does not have."""
    with _LOCK:
        table = _BUILTIN.setdefault(arch, {})
        for op, by_key in entries.items():
            for key, value in by_key.items():
                params = value.get("params", value) if isinstance(value, dict) else None
                if isinstance(params, dict):
                    table.setdefault(op, {})[key] = dict(params)
        _MEMORY.clear()
        _FOUND.clear()


def registered_tunables() -> list[Tunable]:
    with _LOCK:
        return list(_TUNABLES)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "gpu"


def device_identity(device: Any = None) -> tuple[str, str]:
    """(GPU name, "sm<major><minor>") of a CUDA device."""
    import torch

    dev = torch.device("cuda" if device is None else device)
    props = torch.cuda.get_device_properties(dev)
    return props.name, f"sm{props.major}{props.minor}"


def cache_path(name: str, arch: str) -> Path:
    """The cache file of a GPU (``$OASR_AUTOTUNE_CACHE`` overrides it)."""
    override = os.environ.get("OASR_AUTOTUNE_CACHE")
    if override:
        return Path(override).expanduser()
    from oasr.defaults import user_cache_dir

    return user_cache_dir("autotune") / f"{_slug(name)}-{arch}.json"


def _read(path: Path, name: str, arch: str) -> dict[str, dict[str, Params]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("oasr.tune: ignoring unreadable autotune cache %s (%s)", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("version") != CACHE_VERSION or data.get("arch") != arch:
        log.warning("oasr.tune: ignoring autotune cache %s (written for another version or GPU)", path)
        return {}
    entries = data.get("entries", {})
    out: dict[str, dict[str, Params]] = {}
    for op, by_key in entries.items():
        if isinstance(by_key, dict):
            out[op] = {k: dict(v["params"]) for k, v in by_key.items() if isinstance(v, dict) and "params" in v}
    return out


def _device_entries(device: Any) -> dict[str, dict[str, Params]]:
    import torch

    dev = torch.device(device)
    ident = f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    entries = _MEMORY.get(ident)
    if entries is None:
        with _LOCK:
            entries = _MEMORY.get(ident)
            if entries is None:
                name, arch = device_identity(dev)
                entries = {op: dict(by_key) for op, by_key in _BUILTIN.get(arch, {}).items()}
                for op, by_key in _read(cache_path(name, arch), name, arch).items():
                    entries.setdefault(op, {}).update(by_key)  # the file wins
                _MEMORY[ident] = entries
    return entries


def clear_memory_cache() -> None:
    """Forget the cache files read so far (the next :func:`tuned_params` reads them again)."""
    with _LOCK:
        _MEMORY.clear()
        _FOUND.clear()


_FOUND: dict[tuple[str, str, Any], Params | None] = {}  # (op, key, device) -> entry or None


def tuned_params(op: str, key: str, device: Any, default: Params) -> Params:
    """The cached launch parameters of ``op`` for ``key`` on ``device``, else ``default``.
    Called at every launch: after the first call per (op, key, device), one dict lookup."""
    if os.environ.get("OASR_AUTOTUNE", "1") in ("0", "false", "no"):
        return default
    memo = (op, key, device)
    try:
        found = _FOUND[memo]
    except KeyError:
        found = _FOUND[memo] = _device_entries(device).get(op, {}).get(key)
    return default if found is None else found


def cuda_event_timer(repeats: int = 20, warmup: int = 3) -> Timer:
    """Median seconds per launch measured with CUDA events on the current stream."""

    def timer(run: Callable[[], Any]) -> float:
        import torch

        for _ in range(warmup):
            run()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        return statistics.median(times)

    return timer


def cuda_graph_timer(repeats: int = 10, inner: int = 10) -> Timer:
    """Seconds of GPU time per launch: ``inner`` launches captured in one CUDA graph, replayed
    (median of ``repeats`` replays), so the Python launch overhead of small kernels does not
    count: inside the executors' graphs it does not exist either. A launch that cannot be
    captured is timed with :func:`cuda_event_timer` instead."""
    events = cuda_event_timer(repeats=max(repeats, 20))

    def timer(run: Callable[[], Any]) -> float:
        import torch

        run()  # outside capture: compiles, plans
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    run()
        except Exception:  # noqa: BLE001 - not capturable: time it eagerly
            del graph
            return events(run)
        seconds = events(graph.replay) / inner
        del graph
        return seconds

    return timer


def _dtype(name: Any) -> Any:
    import torch

    if not isinstance(name, str):
        return name
    return {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
            "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}[name]  # fmt: skip


def autotune(
    ops: Iterable[str] | None = None,
    shapes: dict[str, list[dict]] | None = None,
    *,
    dtypes: Iterable[Any] = ("float16", "bfloat16", "float32"),
    device: Any = None,
    timer: Timer | None = None,
    path: str | Path | None = None,
    identity: tuple[str, str] | None = None,
    save: bool = True,
) -> dict[str, Any]:
    """Time every candidate of the registered tunables and store the fastest per shape key.

    ``ops``: op names to tune (default all registered); ``shapes``: ``{op: [shape dict, ...]}``
    replacing a tunable's representative shapes; ``dtypes``: for tunables that do not fix their
    own. ``timer`` defaults to :func:`cuda_graph_timer` (GPU time); ``identity`` (name, arch)
    and ``path`` default to the current GPU's and its cache file. Entries already in the file
    for other keys are kept. Returns the report: ``{"path", "device", "arch", "entries":
    {op: {key: {"params", "us", "default_us", "native_us", "candidates"}}}}``; with a native
    reference, ``params["use_kernel"]`` says whether the kernel beat it.

    Before timing, the ``cuda`` kernel providers are installed (``oasr-kernels`` registers its
    tunables there)."""
    if identity is None or device is None:
        import torch

        if not torch.cuda.is_available():
            from oasr.errors import UnsupportedOptionError

            raise UnsupportedOptionError("autotune needs a CUDA GPU", param="device")
        device = torch.device("cuda") if device is None else torch.device(device)
        if identity is None:
            identity = device_identity(device)
        from oasr.kernel_providers import install_kernel_providers

        install_kernel_providers("cuda")
    name, arch = identity
    timer = timer or cuda_graph_timer()
    wanted = set(ops) if ops is not None else None
    tunables = [t for t in registered_tunables() if wanted is None or t.op in wanted]
    if wanted is not None:
        missing = wanted - {t.op for t in registered_tunables()}
        if missing:
            raise KeyError(f"no tunable kernel for {sorted(missing)}; tunable ops: "
                           f"{sorted({t.op for t in registered_tunables()})}")  # fmt: skip
    target = Path(path) if path is not None else cache_path(name, arch)
    stored = _read(target, name, arch) if save else {}
    report: dict[str, dict[str, Any]] = {}
    for tunable in tunables:
        op_shapes = (shapes or {}).get(tunable.op, tunable.shapes)
        for dtype in tunable.dtypes or [_dtype(d) for d in dtypes]:
            for shape in op_shapes:
                key = tunable.key(shape, dtype)
                run = tunable.make(shape, dtype, device)
                results: list[tuple[float, Params]] = []
                default = tunable.default(shape)
                default_s: float | None = None
                for params in tunable.candidates(shape):
                    if run(params) is None:  # cannot launch with these parameters
                        continue
                    seconds = timer(lambda p=params, r=run: r(p))
                    results.append((seconds, params))
                    if params == default:
                        default_s = seconds
                if not results:
                    continue
                best_s, best = min(results, key=lambda r: r[0])
                native_s: float | None = None
                if tunable.native is not None:
                    native_s = timer(tunable.native(shape, dtype, device))
                    best = {**best, "use_kernel": best_s <= native_s}
                entry = {
                    "params": best,
                    "us": round(best_s * 1e6, 3),
                    "default_us": None if default_s is None else round(default_s * 1e6, 3),
                    "native_us": None if native_s is None else round(native_s * 1e6, 3),
                    "candidates": len(results),
                    "shape": shape,
                    "dtype": str(dtype).replace("torch.", ""),
                }
                report.setdefault(tunable.op, {})[key] = entry
                stored.setdefault(tunable.op, {})[key] = best
    if save:
        merged: dict[str, dict[str, Any]] = {}
        for op, by_key in stored.items():
            for key, params in by_key.items():
                merged.setdefault(op, {})[key] = report.get(op, {}).get(key, {"params": params})
        target.parent.mkdir(parents=True, exist_ok=True)
        payload = {"version": CACHE_VERSION, "device": name, "arch": arch,
                   "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "entries": merged}  # fmt: skip
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, indent=1, sort_keys=True))
        tmp.replace(target)
        clear_memory_cache()
    return {"path": str(target), "device": name, "arch": arch, "entries": report}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m oasr.tune [--ops a,b] [--dtypes float16,...] [--out FILE]``: tune this GPU's
    kernels and print the report (JSON)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m oasr.tune", description="Autotune oasr-kernels' launch parameters")
    ap.add_argument("--ops", help="comma-separated ops (default: every tunable op)")
    ap.add_argument("--dtypes", default="float16,bfloat16,float32")
    ap.add_argument("--out", help="cache file to write (default: this GPU's, see docs/autotuning.md)")
    args = ap.parse_args(argv)
    report = autotune(ops=args.ops.split(",") if args.ops else None, dtypes=args.dtypes.split(","), path=args.out)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    # run the imported ``oasr.tune``, not this ``__main__`` copy of it: kernel providers register
    # their tunables with ``oasr.tune``, so this copy's registry stays empty (on the H200, ``python
    # -m oasr.tune`` reported no entries and ``--ops add_norm`` "no tunable kernel")
    from oasr.tune import main as _main

    raise SystemExit(_main())

"""A disk cache of online quantization's results: the quantized weights and their scales.

Online quantization (``EngineConfig(quantization=...)``, ``oasr transcribe --compute-type int8``)
quantizes every linear of the model each time a process loads it (tiny.en: 64 layers and the
51 864-row tied output projection, about 0.1 s of CPU). :func:`load` and :func:`store` keep what
:func:`~oasr.quantization.numerics.quantize_weight` returned for each layer in one safetensors
file per (checkpoint, method, ...), so a later process adopts them instead
(:func:`oasr.quantization.apply.quantize_model` with ``source=``, as
:func:`oasr.checkpoint.load_model` calls it).

Where: ``$OASR_QUANT_CACHE_DIR``, else ``$XDG_CACHE_HOME/oasr/quantized`` (``~/.cache/...``).
``OASR_QUANT_CACHE=0`` turns it off. An entry is keyed by

* the checkpoint: its resolved path and the name, size and modification time of every file in
  it (not their contents: a file rewritten in place with the same size and time is not seen;
  turn the cache off or delete the directory then);
* what was asked: the method, the device type, each network's dtype, whether the tied output
  projection is quantized, the family's keep list, and the names and shapes of the layers to
  quantize;
* the code: torch's version and the text of ``numerics.py`` (the quantization math).

Writing an entry removes older ones of the same checkpoint path and options (so a checkpoint
changed in place, or a new OASR or torch, does not leave entries behind). Anything unreadable, short or mismatched is
ignored (the model is quantized as without a cache), and a cache that cannot be written
(read-only home, full disk) only costs the time it tried. The result is the same either way:
the cached tensors are the ones quantization produced, bit for bit
(``tests/quantization/test_cache.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from oasr.defaults import user_cache_dir

__all__ = ["CACHE_ENV", "DIR_ENV", "cache_dir", "enabled", "entry_path", "load", "store"]

log = logging.getLogger(__name__)

#: on/off switch (``OASR_QUANT_CACHE=0``: quantize every time)
CACHE_ENV = "OASR_QUANT_CACHE"
#: the cache's directory
DIR_ENV = "OASR_QUANT_CACHE_DIR"
#: bumped when an entry's layout changes
_LAYOUT = 1


def enabled() -> bool:
    from oasr.defaults import env_switch

    return env_switch(CACHE_ENV, True)


def cache_dir() -> Path:
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override).expanduser()
    return user_cache_dir("quantized")


def _files(source: Path) -> list[list[Any]]:
    paths = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    out = []
    for p in paths:
        st = p.stat()
        out.append([p.name, st.st_size, st.st_mtime_ns])
    return out


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:24]


def entry_path(source: Path, method: str, device: str, plan: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """(the entry's file, its full key) for ``source`` quantized with ``method`` on ``device``
    (a device type); ``plan``: what is quantized (networks' dtypes, tied, keep list, layer names
    and shapes, from :func:`oasr.quantization.apply.quantize_model`)."""
    from oasr.quantization import numerics

    source = Path(source).resolve()
    where = {"source": str(source), "method": method, "device": device, "plan": plan}
    key = {
        **where,
        "layout": _LAYOUT,
        "files": _files(source),
        "torch": torch.__version__,
        "numerics": hashlib.sha256(Path(numerics.__file__).read_bytes()).hexdigest()[:24],
    }
    return cache_dir() / f"{_digest(where)}-{_digest(key)}.safetensors", key


def load(path: Path, key: dict[str, Any]) -> dict[str, tuple[torch.Tensor, torch.Tensor]] | None:
    """``{layer name: (qweight, weight_scale)}`` from the entry at ``path`` when it exists and was
    written for ``key``; None otherwise (and on any read error)."""
    if not path.is_file():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if json.loads((f.metadata() or {}).get("key", "null")) != key:
                return None
            names = {k.rsplit(".", 1)[0] for k in f.keys()}
            out = {n: (f.get_tensor(f"{n}.qweight"), f.get_tensor(f"{n}.weight_scale")) for n in names}
    except Exception as exc:  # noqa: BLE001 - a damaged entry is a miss, whatever safetensors raises
        log.info("quantization cache entry %s unreadable (%s: %s); quantizing", path, type(exc).__name__, exc)
        return None
    return out


def store(path: Path, key: dict[str, Any], weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """Write an entry (atomically: a temporary file renamed) and remove the older entries of the
    same checkpoint path and options. False when it could not be written."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, (qweight, scale) in weights.items():
        tensors[f"{name}.qweight"] = qweight.detach().cpu().contiguous()
        tensors[f"{name}.weight_scale"] = scale.detach().float().cpu().contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp), metadata={"key": json.dumps(key, sort_keys=True)})
        os.replace(tmp, path)
        prefix = path.name.split("-", 1)[0] + "-"
        for old in path.parent.glob(f"{prefix}*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
    except Exception as exc:  # noqa: BLE001 - a cache that cannot be written is only slower
        log.info("quantization cache %s not written (%s: %s)", path, type(exc).__name__, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    return True

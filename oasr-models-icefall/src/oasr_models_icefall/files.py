"""Finding and reading the files of an icefall experiment or release directory.

Weights, in order: ``pretrained.pt`` (``{"model": state_dict}``, what icefall's ``export.py``
writes), then ``pretrained-*.pt`` / ``epoch-N.pt`` / ``checkpoint-N.pt`` (largest N), searched in
the directory and in its ``exp/``. ``epoch`` + ``avg`` (icefall's ``--epoch`` / ``--avg``)
average ``epoch-(epoch-avg+1) .. epoch-epoch`` (or ``checkpoint-*`` with ``iteration``).
TorchScript exports (``jit_*.pt``, ``cpu_jit.pt``) are not read.

Tokens: ``tokens.txt`` (``piece id`` per line) or a sentencepiece ``bpe.model`` (its pieces are
read from the protobuf directly; sentencepiece itself is not needed to decode), searched beside
the weights, in the directory, its parent, and ``data/lang_bpe_*/`` / ``data/lang_*/`` of each.

No torch import at module level (``formats.detect`` uses this module).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError

_NUMBERED = re.compile(r"^(epoch|checkpoint)-(\d+)\.pt$")


def _weight_dirs(path: Path) -> list[Path]:
    return [d for d in (path, path / "exp") if d.is_dir()]


def _is_jit(p: Path) -> bool:
    return p.name.startswith("jit") or p.name.endswith("_jit.pt") or "jit_" in p.name


def find_weights_cheap(path: Path) -> Path | None:
    """The weights file icefall would decode with (see the module docstring), by name only."""
    for d in _weight_dirs(path):
        if (d / "pretrained.pt").is_file():
            return d / "pretrained.pt"
    for d in _weight_dirs(path):
        pretrained = sorted(p for p in d.glob("pretrained*.pt") if p.is_file())
        if pretrained:
            return pretrained[-1]
        numbered = []
        for p in d.glob("*.pt"):
            m = _NUMBERED.match(p.name)
            if m and p.is_file():
                numbered.append(((m.group(1) == "epoch"), int(m.group(2)), p))
        if numbered:
            return max(numbered)[2]
    return None


def numbered(path: Path, kind: str, last: int, avg: int) -> list[Path]:
    """``kind-(last-avg+1).pt .. kind-last.pt`` in the directory or its ``exp/``."""
    for d in _weight_dirs(path):
        files = [d / f"{kind}-{n}.pt" for n in range(last - avg + 1, last + 1)]
        if all(f.is_file() for f in files):
            return files
    raise CheckpointError(f"{path}: averaging {kind}-{last - avg + 1}.pt .. {kind}-{last}.pt needs all "
                          f"{avg} files (in {path} or {path / 'exp'}); some are missing")


def numbered_pair(path: Path, kind: str, start: int, end: int) -> tuple[Path, Path]:
    """``kind-start.pt`` and ``kind-end.pt`` in the directory or its ``exp/``."""
    for d in _weight_dirs(path):
        a, b = d / f"{kind}-{start}.pt", d / f"{kind}-{end}.pt"
        if a.is_file() and b.is_file():
            return a, b
    raise CheckpointError(f"{path}: --use-averaged-model needs {kind}-{start}.pt and {kind}-{end}.pt "
                          f"(in {path} or {path / 'exp'})")


def find_tokens(path: Path) -> Path | None:
    """``tokens.txt`` or ``bpe.model`` for a model in ``path`` (see the module docstring)."""
    roots = [path, path.parent, path.parent.parent] if path.name == "exp" else [path, path.parent]
    for name in ("tokens.txt", "bpe.model"):
        for root in roots:
            if not root.is_dir():
                continue
            for cand in (root / name, *sorted(root.glob(f"data/lang_bpe_*/{name}")),
                         *sorted(root.glob(f"data/lang_*/{name}"))):  # fmt: skip
                if cand.is_file():
                    return cand
    return None


def read_tokens(path: Path) -> list[str]:
    """The token table, id -> piece."""
    if path.name.endswith(".model"):
        return _sentencepiece_pieces(path.read_bytes(), path)
    table: dict[int, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise CheckpointError(f"{path}:{n}: expected 'piece id', got {line!r}")
        table[int(parts[1])] = parts[0]
    if not table or sorted(table) != list(range(len(table))):
        raise CheckpointError(f"{path}: token ids must be 0..N-1 without gaps")
    return [table[i] for i in range(len(table))]


def _varint(b: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        c = b[i]
        i += 1
        value |= (c & 0x7F) << shift
        if not c & 0x80:
            return value, i
        shift += 7


def _sentencepiece_pieces(data: bytes, path: Path) -> list[str]:
    """``ModelProto.pieces[*].piece`` (field 1, each a message whose field 1 is the string)."""
    pieces: list[str] = []
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            field, wire = key >> 3, key & 7
            if wire == 0:
                _, i = _varint(data, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                n, i = _varint(data, i)
                if field == 1:
                    sub, j = data[i : i + n], 0
                    while j < len(sub):
                        k, j = _varint(sub, j)
                        if k & 7 == 2:
                            m, j = _varint(sub, j)
                            if k >> 3 == 1:
                                pieces.append(sub[j : j + m].decode("utf-8"))
                            j += m
                        elif k & 7 == 0:
                            _, j = _varint(sub, j)
                        elif k & 7 == 5:
                            j += 4
                        else:
                            j += 8
                i += n
            else:
                raise ValueError(f"wire type {wire}")
    except (IndexError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: not a sentencepiece model: {exc}") from exc
    if not pieces:
        raise CheckpointError(f"{path}: a sentencepiece model without pieces")
    return pieces


def _torch_load(f: Path) -> Any:
    """``torch.load`` of an icefall checkpoint. ``pretrained.pt`` loads with
    ``weights_only=True``; a training checkpoint (``epoch-N.pt``) also pickles the run's
    ``params`` and sampler state, whose classes (icefall's, lhotse's) need not be installed:
    those load as empty placeholders (only the ``model`` tensors are used)."""
    import pickle

    import torch

    try:
        return torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        pass  # not tensors and plain containers only: a training checkpoint
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"cannot read {f}: {type(exc).__name__}: {exc}") from exc

    class _Placeholder(dict):  # takes what a pickled object, dict or list would be given
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()

        def __setstate__(self, state: Any) -> None:
            pass

        def append(self, item: Any) -> None:
            pass

        def extend(self, items: Any) -> None:
            pass

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                return _Placeholder

    tolerant = type(pickle)("icefall_tolerant_pickle")
    tolerant.__dict__.update({k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
    tolerant.Unpickler = _Unpickler
    try:
        return torch.load(f, map_location="cpu", weights_only=False, pickle_module=tolerant)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read {f}: {type(exc).__name__}: {exc}") from exc


def load_state(files: list[Path]) -> dict[str, Any]:
    """The state dict of one file, or the average of several as icefall's
    ``average_checkpoints`` computes it (summed in the stored dtype, then floating tensors
    divided by the count and integer ones floor-divided)."""
    import torch

    avg: dict[str, Any] | None = None
    for f in files:
        obj = _torch_load(f)
        if isinstance(obj, torch.jit.ScriptModule):
            raise CheckpointError(f"{f} is a TorchScript export; use pretrained.pt or epoch-N.pt")
        sd = obj.get("model", obj) if isinstance(obj, dict) else None
        if not isinstance(sd, dict) or not sd or not all(isinstance(v, torch.Tensor) for v in sd.values()):
            raise CheckpointError(f"{f} does not hold a state dict (expected {{'model': state_dict}})")
        sd = {k.removeprefix("module."): v for k, v in sd.items()}
        if avg is None:
            avg = {k: v.clone() if len(files) > 1 else v for k, v in sd.items()}
            continue
        if set(sd) != set(avg):
            raise CheckpointError(f"{f} has other tensors than {files[0]}; cannot average them")
        for k, v in sd.items():
            avg[k] += v
    assert avg is not None
    if len(files) > 1:
        for v in avg.values():
            if v.is_floating_point():
                v /= len(files)
            else:
                v //= len(files)
    return avg


def load_averaged_model(start: Path, end: Path) -> dict[str, Any]:
    """icefall's ``--use-averaged-model``: the average over the batches between two training
    checkpoints from their running averages (``model_avg``), as icefall's
    ``average_checkpoints_with_averaged_model`` computes it: with ``s`` / ``e`` the checkpoints'
    ``batch_idx_train`` rounded down to ``average_period``,
    ``(avg_e + avg_s * (w_s / w_e)) * w_e`` where ``w_e = e / (e - s)``, ``w_s = 1 - w_e``."""
    first, last = _torch_load(start), _torch_load(end)
    try:
        period = first["average_period"]
        s_idx = (first["batch_idx_train"] // period) * period
        e_idx = (last["batch_idx_train"] // period) * period
        model_start, avg = first["model_avg"], last["model_avg"]
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{start} / {end}: not icefall training checkpoints with an averaged "
                              f"model (missing {exc}); use plain averaging instead") from None
    if e_idx <= s_idx:
        raise CheckpointError(f"{end} was not trained past {start}; cannot average between them")
    w_end = e_idx / (e_idx - s_idx)
    w_start = 1 - w_end
    seen: set[int] = set()
    for k, v in avg.items():
        if v.data_ptr() in seen or not v.is_floating_point():
            continue
        seen.add(v.data_ptr())
        v *= 1.0
        v += model_start[k] * (w_start / w_end)
        v *= w_end
    return {k.removeprefix("module."): v for k, v in avg.items()}

"""A reader for CTranslate2's ``model.bin`` (the format faster-whisper ships), written from the
format's description; it needs numpy only (no ctranslate2 import).

Layout (all integers little-endian)::

    u32  binary_version          (this reader accepts 4..6)
    str  spec name               ("WhisperSpec")
    u32  spec revision
    u32  number of variables
    per variable:
        str  name                ("encoder/layer_0/self_attention/linear_0/weight")
        u8   rank
        u32  dims[rank]
        u8   dtype id            (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16)
        u32  number of bytes
        bytes data               (row-major)
    u32  number of aliases       (version >= 3)
    per alias: str alias name, str target variable name

where ``str`` is a u16 length (counting a trailing NUL) followed by that many bytes.

Quantized weights: ``<x>/weight`` is int8 or int16 and ``<x>/weight_scale`` holds the scale
(per output row for int8, a scalar for int16) such that ``weight_fp = weight / scale``.
:func:`dequantize` applies that and returns float32 tensors.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np

from oasr.errors import CheckpointError

_DTYPES: dict[int, np.dtype] = {
    0: np.dtype("<f4"),
    1: np.dtype("i1"),
    2: np.dtype("<i2"),
    3: np.dtype("<i4"),
    4: np.dtype("<f2"),
    5: np.dtype("<u2"),  # bfloat16: raw bits, widened by :func:`to_float32`
}
DTYPE_NAMES = {0: "float32", 1: "int8", 2: "int16", 3: "int32", 4: "float16", 5: "bfloat16"}
_SUPPORTED_VERSIONS = range(4, 7)  # Whisper needs >= 5; 4 introduced dtype ids


@dataclass
class CT2Model:
    """Everything in one ``model.bin``: arrays keyed by variable name, aliases resolved."""

    binary_version: int
    spec_name: str
    spec_revision: int
    variables: dict[str, np.ndarray]
    #: variable name -> dtype name ("float32", "int8", "bfloat16", ...)
    dtypes: dict[str, str] = field(default_factory=dict)
    #: alias name -> target variable name (aliased arrays are also present in ``variables``)
    aliases: dict[str, str] = field(default_factory=dict)

    def float32(self, name: str) -> np.ndarray:
        """Variable ``name`` as float32, dequantized with ``<name>_scale`` when it is integer."""
        return to_float32(self.variables[name], self.dtypes[name], self._scale_for(name))

    def _scale_for(self, name: str) -> np.ndarray | None:
        scale = self.variables.get(name + "_scale")
        if scale is None:
            return None
        return to_float32(scale, self.dtypes[name + "_scale"], None)


class _Reader:
    """Sequential little-endian reads from a binary file, with truncation errors."""

    def __init__(self, fh: BinaryIO, path: Path) -> None:
        self.fh = fh
        self.path = path

    def take(self, n: int) -> bytes:
        out = self.fh.read(n)
        if len(out) != n:
            raise CheckpointError(
                f"{self.path} is truncated (wanted {n} bytes at offset {self.fh.tell() - len(out)})"
            )
        return out

    def into(self, arr: np.ndarray) -> None:
        view = memoryview(arr.reshape(-1)).cast("B")
        got = self.fh.readinto(view)
        if got != view.nbytes:
            raise CheckpointError(f"{self.path} is truncated (wanted {view.nbytes} bytes of data)")

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("<H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("<I", self.take(4))[0]

    def string(self) -> str:
        return self.take(self.u16()).rstrip(b"\0").decode("utf-8")

    def at_end(self) -> bool:
        pos = self.fh.tell()
        more = self.fh.read(1)
        self.fh.seek(pos)
        return not more


def read_header(path: str | Path) -> tuple[int, str, int]:
    """(binary_version, spec name, spec revision) from the first bytes of ``model.bin``; cheap."""
    path = Path(path)
    with path.open("rb") as fh:
        r = _Reader(fh, path)
        version = r.u32()
        if version < 2:
            return version, "", 1
        return version, r.string(), r.u32()


def read_model_bin(path: str | Path) -> CT2Model:
    """Parse ``path`` (a ``model.bin``) completely. Arrays are read straight from the file into
    their own (aligned, writable) buffers, so peak memory is about one copy of the weights."""
    path = Path(path)
    try:
        fh = path.open("rb")
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    with fh:
        return _read(_Reader(fh, path), path)


def _read(r: _Reader, path: Path) -> CT2Model:
    version = r.u32()
    if version not in _SUPPORTED_VERSIONS:
        raise CheckpointError(
            f"{path} is CTranslate2 binary version {version}; this reader supports versions "
            f"{_SUPPORTED_VERSIONS.start}..{_SUPPORTED_VERSIONS.stop - 1}: re-convert it with a "
            f"current ct2-transformers-converter"
        )
    spec_name = r.string()
    revision = r.u32()
    variables: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for _ in range(r.u32()):
        name = r.string()
        rank = r.u8()
        shape = tuple(r.u32() for _ in range(rank))
        type_id = r.u8()
        if type_id not in _DTYPES:
            raise CheckpointError(f"{path}: variable {name!r} has unknown dtype id {type_id}")
        nbytes = r.u32()
        dt = _DTYPES[type_id]
        count = int(np.prod(shape)) if shape else 1
        if count * dt.itemsize != nbytes:
            raise CheckpointError(
                f"{path}: variable {name!r} of shape {shape} ({DTYPE_NAMES[type_id]}) "
                f"has {nbytes} bytes"
            )
        arr = np.empty(shape, dtype=dt)
        r.into(arr)
        variables[name] = arr
        dtypes[name] = DTYPE_NAMES[type_id]
    aliases: dict[str, str] = {}
    if not r.at_end():
        for _ in range(r.u32()):
            alias = r.string()
            target = r.string()
            aliases[alias] = target
    for alias, target in aliases.items():
        if target not in variables:
            raise CheckpointError(f"{path}: alias {alias!r} points at missing {target!r}")
        variables[alias] = variables[target]
        dtypes[alias] = dtypes[target]
    return CT2Model(version, spec_name, revision, variables, dtypes, aliases)


def to_float32(arr: np.ndarray, dtype: str, scale: np.ndarray | None) -> np.ndarray:
    """Widen ``arr`` (stored as ``dtype``) to float32; integer weights are divided by ``scale``
    (per leading row, or a scalar)."""
    if dtype == "float32":
        return arr
    if dtype == "float16":
        return arr.astype(np.float32)
    if dtype == "bfloat16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("int8", "int16", "int32"):
        if scale is None:
            # An integer variable without a scale is a scalar/config value, not a weight.
            return arr.astype(np.float32)
        out = arr.astype(np.float32)
        s = np.asarray(scale, dtype=np.float32)
        if s.ndim == 0 or s.size == 1:
            return out / s.reshape(())
        return out / s.reshape((-1,) + (1,) * (out.ndim - 1))
    raise CheckpointError(f"cannot convert CTranslate2 dtype {dtype!r} to float32")

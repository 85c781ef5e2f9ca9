"""Whisper checkpoint formats registered on the ``checkpoint_format`` axis (see ``plugin.py``).

Each class has a cheap ``detect(path)`` (reads at most a JSON file or a few header bytes; never
imports torch) and ``load(path, config)``, which reads the weights with
:mod:`oasr_models_whisper.checkpoints` and builds the ASR model via
``WhisperASR.from_loaded(loaded, config)``.

* ``HFWhisperFormat``: ``config.json`` with ``"model_type": "whisper"`` plus weights
  (``model.safetensors``, a sharded index, or ``pytorch_model.bin``).
* ``CT2WhisperFormat``: ``model.bin`` whose header names ``WhisperSpec`` (faster-whisper).
* ``OpenAIWhisperFormat``: an openai-whisper ``.pt`` file (a torch zip archive whose pickle names
  ``dims`` and ``model_state_dict``), or a directory holding exactly one such file.
"""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig

NATIVE_CONFIG = "oasr_model.json"


def _build(loaded: Any, config: EngineConfig) -> Any:
    from oasr_models_whisper.model import WhisperASR

    return WhisperASR.from_loaded(loaded, config)


def is_native_whisper(path: Path) -> bool:
    try:
        body = json.loads((path / NATIVE_CONFIG).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("architecture") == "whisper"


class HFWhisperFormat:
    """Hugging Face ``transformers`` Whisper directory."""

    @staticmethod
    def detect(path: Path) -> bool:
        from oasr.checkpoint import hf_model_type

        path = Path(path)
        if not path.is_dir() or hf_model_type(path) != "whisper":
            return False
        return any(
            (path / name).is_file()
            for name in (
                "model.safetensors",
                "model.safetensors.index.json",
                "pytorch_model.bin",
                "pytorch_model.bin.index.json",
            )
        )

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_whisper.checkpoints import load_hf

        return _build(load_hf(path), config)


class CT2WhisperFormat:
    """CTranslate2 (faster-whisper) Whisper directory."""

    @staticmethod
    def detect(path: Path) -> bool:
        path = Path(path)
        model = path / "model.bin"
        if not path.is_dir() or not model.is_file():
            return False
        try:
            with model.open("rb") as fh:
                head = fh.read(4 + 2 + 64)
            if len(head) < 6:
                return False
            (n,) = struct.unpack("<H", head[4:6])
            return head[6 : 6 + n].rstrip(b"\0") == b"WhisperSpec"
        except OSError:
            return False

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_whisper.checkpoints import load_ct2

        return _build(load_ct2(path), config)


def _is_openai_pt(file: Path) -> bool:
    if file.suffix not in (".pt", ".pth") or not file.is_file():
        return False
    try:
        with zipfile.ZipFile(file) as zf:
            names = [n for n in zf.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if not names:
                return False
            with zf.open(names[0]) as fh:
                pkl = fh.read(1 << 20)
    except (OSError, zipfile.BadZipFile):
        return False
    return b"model_state_dict" in pkl and b"dims" in pkl


class OpenAIWhisperFormat:
    """openai-whisper ``.pt`` checkpoint (file, or a directory with exactly one)."""

    @staticmethod
    def detect(path: Path) -> bool:
        path = Path(path)
        if path.is_file():
            return _is_openai_pt(path)
        if path.is_dir():
            pts = [p for p in path.glob("*.pt") if p.is_file()]
            return len(pts) == 1 and _is_openai_pt(pts[0])
        return False

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_whisper.checkpoints import load_openai

        return _build(load_openai(path), config)

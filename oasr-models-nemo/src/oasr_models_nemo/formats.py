"""Checkpoint formats (registered in ``plugin.py``); ``detect`` reads file names and, for the
Hugging Face layout, ``config.json``'s ``model_type`` only (no torch).

* ``hf-parakeet``: a directory with ``config.json`` whose ``model_type`` is ``parakeet_ctc``,
  ``parakeet_rnnt``, ``parakeet_tdt`` or ``nemotron_asr_streaming`` and ``model.safetensors``
  (or its index);
* ``nemo``: a ``.nemo`` archive, a directory holding exactly one (as the Hub repos of NVIDIA's
  models do), or an extracted one (``model_config.yaml`` + ``model_weights.ckpt``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig

HF_MODEL_TYPES = ("parakeet_ctc", "parakeet_rnnt", "parakeet_tdt", "nemotron_asr_streaming")


class HFParakeetFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        from oasr.checkpoint import hf_model_type

        path = Path(path)
        if not path.is_dir() or hf_model_type(path) not in HF_MODEL_TYPES:
            return False
        return any((path / n).is_file() for n in ("model.safetensors", "model.safetensors.index.json"))

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_nemo.model import NemoASR

        return NemoASR.from_hf(path, config)


class NemoArchiveFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        path = Path(path)
        if path.is_file():
            return path.suffix == ".nemo"
        if not path.is_dir() or (path / "oasr_model.json").is_file():
            return False
        if (path / "model_config.yaml").is_file() and (path / "model_weights.ckpt").is_file():
            return True
        return len(list(path.glob("*.nemo"))) == 1

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_nemo.model import NemoASR

        return NemoASR.from_nemo(path, config)

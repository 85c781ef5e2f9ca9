"""The ``funasr`` checkpoint format (registered in ``plugin.py``).

``detect`` is cheap (file names and one short read; no torch): a directory with ``config.yaml``,
``model.pt`` and ``tokens.json`` / ``tokens.txt`` whose ``config.yaml`` names a ``model:`` class
(FunASR's layout). Unsupported model classes are still claimed, so loading says which class is not
supported instead of "unknown format".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig

_MODEL_LINE = re.compile(r"^model:\s*\S+", re.MULTILINE)


class FunASRFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        path = Path(path)
        if not path.is_dir() or (path / "oasr_model.json").is_file():
            return False
        cfg = path / "config.yaml"
        if not cfg.is_file() or not (path / "model.pt").is_file():
            return False
        if not ((path / "tokens.json").is_file() or (path / "tokens.txt").is_file()):
            return False
        try:
            head = cfg.read_text(encoding="utf-8", errors="replace")[:200_000]
        except OSError:
            return False
        return bool(_MODEL_LINE.search(head))

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_funasr.model import ParaformerASR

        return ParaformerASR.from_release(path, config)

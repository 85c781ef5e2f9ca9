"""The ``wenet`` checkpoint format (registered in ``plugin.py``).

``detect`` is cheap (file names only; no torch, no YAML parse): a directory with ``train.yaml``,
a unit table (``units.txt`` / ``words.txt`` / ``lang_char.txt`` / ``tokens.txt``) and a ``.pt``
file, or such a ``.pt`` file itself. A native OASR directory is never claimed (native has the
higher priority anyway).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig

UNIT_NAMES = ("units.txt", "words.txt", "lang_char.txt", "tokens.txt")


class WenetFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        path = Path(path)
        if path.is_file():
            if path.suffix != ".pt":
                return False
            path = path.parent
        if not path.is_dir() or (path / "oasr_model.json").is_file():
            return False
        if not (path / "train.yaml").is_file():
            return False
        if not any((path / n).is_file() for n in UNIT_NAMES):
            return False
        return any(p.is_file() for p in path.glob("*.pt"))

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_wenet.model import WenetASR

        return WenetASR.from_wenet(path, config)

"""The ``icefall`` checkpoint format (registered in ``plugin.py``).

``detect`` is cheap (file names only, no torch): a directory holding icefall weights
(``pretrained.pt``, ``epoch-N.pt``, ``checkpoint-N.pt``, or ``pretrained-*.pt``, directly or in
``exp/``) and icefall tokens (``tokens.txt`` or ``bpe.model``, beside them or in
``data/lang_*/``), or such a ``.pt`` file itself. WeNet directories (``train.yaml``) and native
OASR directories are never claimed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from oasr.types import EngineConfig


class IcefallFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        from oasr_models_icefall.files import find_tokens, find_weights_cheap

        path = Path(path)
        if path.is_file():
            return path.suffix == ".pt" and find_tokens(path.parent) is not None and \
                not (path.parent / "train.yaml").is_file()
        if not path.is_dir() or (path / "oasr_model.json").is_file() or (path / "train.yaml").is_file():
            return False
        return find_weights_cheap(path) is not None and find_tokens(path) is not None

    @staticmethod
    def load(path: Path, config: EngineConfig) -> Any:
        from oasr_models_icefall.model import load_icefall

        return load_icefall(path, config)

"""OASR plugin: Silero VAD rebuilt on ``oasr.layers``.

Light on import: ``SileroVAD`` (torch) loads on first attribute access.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["SileroVAD", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "SileroVAD":
        from oasr_vad_silero.model import SileroVAD

        return SileroVAD
    raise AttributeError(name)

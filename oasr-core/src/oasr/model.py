"""The model contract every architecture implements, and the checkpoint-format contract.

These are :class:`typing.Protocol` classes: plugins satisfy them structurally and never need to
subclass anything from core.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from oasr.types import DecodingOptions, EngineConfig, FeatureSpec, ModelCapabilities, Transcript

if TYPE_CHECKING:
    import numpy as np

#: Called with (units done, units total) while a long job runs; the CLI draws a progress bar.
ProgressCallback = Callable[[float, float], None]


@runtime_checkable
class ASRModel(Protocol):
    """A loaded, ready-to-run recogniser (encoder, decoder, tokenizer and frontend together)."""

    #: Human-readable name used in error messages ("whisper tiny.en").
    name: str
    capabilities: ModelCapabilities
    feature_spec: FeatureSpec

    def transcribe(
        self,
        audios: Sequence[np.ndarray],
        options: DecodingOptions,
        progress: ProgressCallback | None = None,
    ) -> list[Transcript]:
        """Recognise a batch of mono float32 waveforms at ``feature_spec.sample_rate``."""
        ...


class CheckpointFormat(Protocol):
    """A checkpoint layout on disk (HF, CTranslate2, WeNet, ...).

    ``detect`` must be cheap and must not import torch: it runs for every registered format when
    a directory is opened. ``load`` builds the model.
    """

    @staticmethod
    def detect(path: Path) -> bool: ...

    @staticmethod
    def load(path: Path, config: EngineConfig) -> ASRModel: ...

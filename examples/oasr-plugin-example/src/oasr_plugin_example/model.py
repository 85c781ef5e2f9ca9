"""The toy architecture. A real plugin would import torch and build its network here; this
module is imported only when ``example_energy`` is resolved."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from oasr.types import (
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Segment,
    Transcript,
)
from oasr_plugin_example.plugin import CAPABILITIES

CONFIG_NAME = "example_energy.json"


class EnergyModel:
    """Marks each run of frames louder than ``threshold_db`` as ``[speech]``."""

    capabilities: ModelCapabilities = CAPABILITIES  # declared once, in the hook module

    def __init__(self, threshold_db: float = -35.0, sample_rate: int = 16000) -> None:
        self.name = "example_energy"
        self.threshold_db = threshold_db
        self.feature_spec = FeatureSpec(kind="none", sample_rate=sample_rate)

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions, progress=None) -> list[Transcript]:
        hop = self.feature_spec.hop_length
        rate = self.feature_spec.sample_rate
        out = []
        for audio in audios:
            frames = audio[: len(audio) // hop * hop].reshape(-1, hop) if len(audio) >= hop else np.zeros((0, hop))
            loud = 10 * np.log10(np.mean(frames**2, axis=1) + 1e-12) > self.threshold_db
            segments, start = [], None
            for i, is_loud in enumerate([*loud, False]):
                if is_loud and start is None:
                    start = i
                elif not is_loud and start is not None:
                    segments.append(Segment(len(segments), start * hop / rate, i * hop / rate, "[speech]"))
                    start = None
            text = " ".join(s.text for s in segments)
            out.append(Transcript(text=text, language=None, duration=len(audio) / rate, segments=segments))
        return out


class EnergyFormat:
    @staticmethod
    def detect(path: Path) -> bool:
        return path.is_dir() and (path / CONFIG_NAME).is_file()

    @staticmethod
    def load(path: Path, config: EngineConfig) -> EnergyModel:
        body = json.loads((path / CONFIG_NAME).read_text())
        return EnergyModel(threshold_db=float(body.get("threshold_db", -35.0)))

"""Real speech for the feature frontends (decoded once per session with oasr.audio)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from oasr.audio import load_audio

sys.path.insert(0, str(Path(__file__).parent))

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
FILES = [
    "en_ls_1995-1837-0001.wav",  # 16 kHz LibriSpeech
    "zh_aishell_BAC009S0724W0121.wav",  # 16 kHz AISHELL
    "en_jfk_inaugural.flac",  # 44.1 kHz stereo -> resampled
    "en_ls_2830-3980-0043.wav",  # short (2 s)
]


@pytest.fixture(scope="session")
def speech() -> list[np.ndarray]:
    return [load_audio(SPEECH / f) for f in FILES]


@pytest.fixture(scope="session")
def speech8k() -> np.ndarray:
    return load_audio(SPEECH / "en_osr_us_000_0034_8k.wav", 8000)[: 8000 * 6]

"""Session fixtures: real speech from tests/data/speech re-encoded into many containers."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

sys.path.insert(0, str(Path(__file__).parent))
from _audio_helpers import CASES, CLIP_S, SPEECH  # noqa: E402
from _encode import encode  # noqa: E402


@pytest.fixture(scope="session")
def sources() -> dict[str, tuple[np.ndarray, int]]:
    """Real speech clips (channels, n) float32 with their rates, read with libsndfile."""
    out = {}
    for key, fname in (
        ("stereo44k", "en_jfk_inaugural.flac"),
        ("mono16k", "en_ls_1995-1837-0001.wav"),
    ):
        x, sr = sf.read(SPEECH / fname, dtype="float32", always_2d=True)
        out[key] = (np.ascontiguousarray(x[: int(sr * CLIP_S)].T), sr)
    return out


@pytest.fixture(scope="session")
def encoded(tmp_path_factory, sources) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("containers")
    paths = {}
    for c in CASES:
        x, sr = sources[c.source]
        paths[c.name] = encode(
            x, sr, d / c.name, container=c.container, codec=c.codec, out_rate=c.out_rate,
            bit_rate=c.bit_rate,
        )
    return paths



"""WeNet fixtures: the three random-weight checkpoints in WeNet's layout under
tests/data/wenet (see its README for how WeNet itself produced the golden outputs), loaded once
per session, plus real speech."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "wenet"
SPEECH = REPO / "tests" / "data" / "speech"
VARIANTS = ("u2pp_conformer", "u2_conformer_conv2d6", "conformer_conv2d8_bpe")



@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    """The test models are tiny: one thread is fastest, and immune to OpenMP spin-waiting when
    the machine is loaded (measured: 7 s for tests/wenet + tests/decoders with one thread, up
    to 110 s with two on a busy 2-core machine). Restored afterwards for other packages."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


class Golden:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = DATA / name
        self.arrays = dict(np.load(self.dir / "golden.npz"))
        self.meta = json.loads((self.dir / "golden.json").read_text())

    @property
    def feats(self) -> list[torch.Tensor]:
        return [torch.from_numpy(self.arrays["feats_0"]), torch.from_numpy(self.arrays["feats_1"])]

    def run(self, key: str) -> dict:
        return next(r for r in self.meta["runs"] if r["key"] == key)


_MODELS: dict[str, object] = {}


def load(name: str):
    if name not in _MODELS:
        from oasr.checkpoint import load_model
        from oasr.types import EngineConfig

        _MODELS[name] = load_model(EngineConfig(ckpt_dir=str(DATA / name)))
    return _MODELS[name]


@pytest.fixture(scope="session")
def u2pp():
    return load("u2pp_conformer")


@pytest.fixture(scope="session")
def u2_conv2d6():
    return load("u2_conformer_conv2d6")


@pytest.fixture(scope="session")
def bpe8():
    return load("conformer_conv2d8_bpe")


@pytest.fixture(scope="session")
def speech() -> dict[str, np.ndarray]:
    from oasr.audio import load_audio

    names = ["zh_aishell_BAC009S0764W0121.wav", "zh_aishell_BAC009S0724W0121.wav",
             "zh_sr_chinese.flac", "en_sr_one_two_three.wav"]
    return {n: load_audio(SPEECH / n, 16000) for n in names}

"""Shared fixtures: random-weight FunASR releases (written once per session in FunASR's published
layout), real speech clips, and FunASR's own ``AutoModel`` on them."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
ZH_CLIPS = ["zh_aishell_BAC009S0724W0121.wav", "zh_aishell_BAC009S0764W0121.wav",
            "zh_aishell_BAC009S0764W0122.wav"]  # fmt: skip
EN_CLIPS = ["en_ls_1089-134686-0001.wav", "en_ls_1221-135766-0002.wav", "en_ls_2830-3980-0043.wav"]


def read_wav(name: str) -> np.ndarray:
    """16 kHz PCM16 mono WAV -> float32 (no PyAV needed: the GPU machine may lack it)."""
    with wave.open(str(SPEECH / name)) as w:
        assert w.getframerate() == 16000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        return np.frombuffer(w.readframes(w.getnframes()), np.int16).astype(np.float32) / 32768


@pytest.fixture(scope="session")
def clips() -> dict[str, np.ndarray]:
    return {name: read_wav(name) for name in ZH_CLIPS + EN_CLIPS}


@pytest.fixture(scope="session")
def releases(tmp_path_factory, clips) -> dict[str, Path]:
    """name -> release directory: ``zh`` (Paraformer, CJK characters), ``en`` (Paraformer,
    ``@@`` BPE pieces), ``bicif`` (BiCifParaformer, CJK characters), ``seaco`` (SeacoParaformer
    with the BiCif timestamp predictor, CJK characters); BiCif and SeACo with the released
    ``cnn_blstm`` timestamp head, ``bicif_cnn`` with the plain ``cnn`` one. Their ``am.mvn``
    holds the clips' feature statistics."""
    from oasr_models_funasr.testing import en_tokens, write_release, zh_tokens

    root = tmp_path_factory.mktemp("funasr")
    audio = list(clips.values())

    def rel(name: str, **kw) -> Path:  # noqa: ANN003
        return write_release(root / name, cmvn_audio=audio, **kw)

    return {
        "zh": rel("zh", tokens=zh_tokens(), seed=1),
        "en": rel("en", tokens=en_tokens(), seed=2),
        "bicif": rel("bicif", model="BiCifParaformer", tokens=zh_tokens(), seed=3),
        "seaco": rel("seaco", model="SeacoParaformer", tokens=zh_tokens(), seed=4),
        "bicif_cnn": rel(
            "bicif_cnn", model="BiCifParaformer", tokens=zh_tokens(), seed=5, upsample_type="cnn"
        ),  # fmt: skip
    }


class FunASRReference:
    """``funasr.AutoModel`` per release, built once."""

    def __init__(self, releases: dict[str, Path]) -> None:
        self.releases = releases
        self._models: dict[str, object] = {}

    def model(self, name: str):  # noqa: ANN201
        if name not in self._models:
            import logging

            import torch
            from funasr import AutoModel

            # ncpu: AutoModel sets torch's thread count to it (4 by default) for the process
            self._models[name] = AutoModel(
                model=str(self.releases[name]), device="cpu", disable_update=True,
                disable_pbar=True, disable_log=True, log_level="ERROR",
                ncpu=torch.get_num_threads(),
            )  # fmt: skip
            logging.getLogger().setLevel(logging.WARNING)
        return self._models[name]

    def generate(self, name: str, audio: np.ndarray, **kw) -> dict:  # noqa: ANN003
        res = self.model(name).generate(input=audio, disable_pbar=True, **kw)
        return res[0] if res else {"text": "", "timestamp": []}


@pytest.fixture(scope="session")
def funasr_ref(releases) -> FunASRReference:
    return FunASRReference(releases)

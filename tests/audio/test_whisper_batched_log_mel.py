"""Whisper's batched admission log-mel (``engine_adapter.batched_whole_log_mels``): recordings
of different lengths from one zero-padded STFT give exactly the log-mel of each alone
(``whole_log_mel``), frame count included: silence, a clip over 30 s and equal lengths too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("oasr_models_whisper")
from oasr.audio import load_audio  # noqa: E402
from oasr_models_whisper.engine_adapter import batched_whole_log_mels  # noqa: E402
from oasr_models_whisper.transcribe import whole_log_mel  # noqa: E402

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"


def _waves() -> list[torch.Tensor]:
    rows = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines() if line]
    names = ["en_ljspeech_LJ002-0020.wav", "en_ls_2830-3980-0043.wav", "en_fleurs_000.ogg",
             "en_osr_us_000_0034_8k.wav", "en_ls_1272-141231-0002.mp3"]  # fmt: skip
    assert {r["audio"] for r in rows} >= set(names)
    waves = [torch.from_numpy(load_audio(SPEECH / n, 16000)) for n in names]
    silence = torch.zeros(12345)
    return [*waves, silence, waves[1].clone()]  # 1.5 s .. 35.5 s, silence, a repeated length


def _check(device: torch.device, n_mels: int) -> None:
    waves = _waves()
    got = batched_whole_log_mels(waves, n_mels, device)
    for w, mel in zip(waves, got, strict=True):
        want = whole_log_mel(w.to(device), n_mels)
        assert mel.shape == want.shape and mel.device.type == device.type
        assert torch.equal(mel, want)


@pytest.mark.parametrize("n_mels", [80, 128])
def test_batched_equals_one_at_a_time_cpu(n_mels: int) -> None:
    _check(torch.device("cpu"), n_mels)


@pytest.mark.gpu
def test_batched_equals_one_at_a_time_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from oasr.kernel_providers import install_kernel_providers

    install_kernel_providers("cuda")  # the log-mel kernels the engine runs with
    _check(torch.device("cuda"), 80)

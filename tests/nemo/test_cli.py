"""The command line with a Parakeet checkpoint: ``oasr transcribe --ckpt-dir DIR`` (text and JSON
with word times, a family option through ``-O``) and ``oasr convert`` to the native format."""

from __future__ import annotations

import json
import wave

import numpy as np
import pytest

from oasr.types import DecodingOptions

from .conftest import SR  # noqa: TID252

pytestmark = pytest.mark.slow


def _wav(path, audio: np.ndarray) -> np.ndarray:
    pcm = np.clip(np.round(audio * 32767), -32768, 32767).astype("<i2")
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SR)
        w.writeframes(pcm.tobytes())
    return pcm.astype(np.float32) / 32768.0


def test_transcribe_and_convert(hf_checkpoints, waves, tmp_path) -> None:
    from typer.testing import CliRunner

    from oasr.cli.main import app
    from oasr_models_nemo.model import NemoASR

    ckpt = hf_checkpoints["tdt"].path
    audio = _wav(tmp_path / "a.wav", waves[0])
    expected = NemoASR.from_hf(ckpt).transcribe([audio], DecodingOptions())[0].text
    runner = CliRunner()
    res = runner.invoke(app, ["transcribe", "--ckpt-dir", str(ckpt),
                              str(tmp_path / "a.wav")])
    assert res.exit_code == 0, res.output
    assert expected in res.output
    res = runner.invoke(app, ["transcribe", "--ckpt-dir", str(ckpt),
                              "--word-timestamps", "--response-format", "verbose_json",
                              "-O", "max_symbols_per_frame=4", str(tmp_path / "a.wav")])
    assert res.exit_code == 0, res.output
    body = json.loads(res.output[res.output.index("{"):])
    assert body["text"] == expected and body["words"]
    res = runner.invoke(app, ["convert", str(ckpt), str(tmp_path / "native")])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "native" / "oasr_model.json").read_text())["architecture"] == "parakeet_tdt"

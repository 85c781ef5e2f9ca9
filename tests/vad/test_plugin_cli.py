"""The ``silero`` plugin registration, ``oasr.vad.get_detector`` and the ``oasr vad`` command."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import typer
from _vad_helpers import FILE_8K, FILES_16K, SPEECH
from typer.testing import CliRunner

from oasr.errors import MissingPluginError
from oasr.plugins import get_registry, reset_plugin_manager
from oasr.vad import VoiceActivityDetector, get_detector, get_speech_segments


@pytest.fixture
def fresh():
    reset_plugin_manager()
    yield
    reset_plugin_manager()


def test_registered_by_the_distribution(fresh):
    spec = get_registry("vad_detector").get("silero")
    assert spec.distribution == "oasr-vad-silero"
    assert spec.target == "oasr_vad_silero.model:SileroVAD"


def test_get_detector_resolves_and_satisfies_protocol(fresh):
    det = get_detector("silero")
    assert type(det).__name__ == "SileroVAD"
    assert isinstance(det, VoiceActivityDetector)
    with pytest.raises(MissingPluginError):
        get_detector("nope")


def test_hook_module_is_light():
    code = (
        "import sys, oasr_vad_silero, oasr_vad_silero.plugin, oasr.vad, oasr.cli.vad\n"
        "bad = [m for m in ('torch', 'silero_vad') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    code = "import sys, oasr.cli.vad; assert 'numpy' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _app() -> typer.Typer:
    from oasr.cli.vad import register

    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """test app"""

    register(app)
    return app


def test_cli_json_matches_library(vad):
    from oasr.audio import load_audio

    f = SPEECH / FILES_16K[0]
    res = CliRunner().invoke(_app(), ["vad", str(f), "--json", "--threshold", "0.6"])
    assert res.exit_code == 0, res.output
    torch.set_num_threads(1)  # the command ran in-process
    (out,) = json.loads(res.stdout)  # a list whatever the number of inputs
    from oasr.vad import SegmentationOptions

    expected = get_speech_segments(
        load_audio(str(f), 16000), 16000, vad, SegmentationOptions(threshold=0.6)
    )
    assert out["file"] == str(f) and out["sample_rate"] == 16000
    assert out["segments"] == [s.to_dict() for s in expected]


def test_cli_table_several_files_and_8k():
    files = [str(SPEECH / FILES_16K[1]), str(SPEECH / FILE_8K)]
    res = CliRunner().invoke(_app(), ["vad", *files, "--sample-rate", "8000", "--min-silence-ms", "300"])
    assert res.exit_code == 0, res.output
    assert "start (s)" in res.stdout and "speech of" in res.stdout
    res = CliRunner().invoke(_app(), ["vad", *files, "--json"])
    data = json.loads(res.stdout)
    assert [d["file"] for d in data] == files and all(d["segments"] for d in data)


def test_cli_errors():
    res = CliRunner().invoke(_app(), ["vad", "/nonexistent.wav"])
    assert res.exit_code == 2
    res = CliRunner().invoke(_app(), ["vad", str(SPEECH / FILES_16K[0]), "--threshold", "3"])
    assert res.exit_code == 1

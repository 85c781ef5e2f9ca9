"""``EngineConfig.decode_processes``: many inputs decoded in worker processes give exactly the
samples, errors and transcripts of decoding them one after another in the caller."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from oasr.audio import load_audio
from oasr.engine import ASREngine
from oasr.errors import AudioTooLongError, BadAudioError
from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Transcript,
)

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
CLIPS = ["en_ls_2830-3980-0043.wav", "en_fleurs_000.ogg", "en_ls_1272-141231-0002.mp3"]


class LengthModel:
    """An ASRModel whose transcript names its input's sample count and first sample."""

    name = "length-model"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
    feature_spec = FeatureSpec(kind="none", sample_rate=16000)

    def transcribe(self, audios: Sequence[np.ndarray], options: DecodingOptions,
                   progress: Any = None) -> list[Transcript]:  # fmt: skip
        return [Transcript(text=f"{len(a)} {a[0]:.6f}", language="en", duration=len(a) / 16000)
                for a in audios]


def engine(processes: int, **kw: Any) -> ASREngine:
    return ASREngine(EngineConfig(decode_processes=processes, **kw), model=LengthModel())


def test_load_audios_equals_one_by_one() -> None:
    paths = [SPEECH / name for name in CLIPS]
    array = np.linspace(-0.5, 0.5, 8000, dtype=np.float32)
    sources: list[Any] = [
        *paths,
        str(paths[0]),
        paths[1].read_bytes(),
        io.BytesIO(paths[2].read_bytes()),  # a file object: read in the caller
        array,
        b"definitely not audio" * 10,
    ]
    eng = engine(2)
    try:
        got = eng.load_audios(sources)
        assert eng._decode_pool is not None and eng._decode_pool.processes == 2
    finally:
        eng.shutdown()
    assert eng._decode_pool is None
    for source, out in zip(sources[:-1], got[:-1], strict=True):
        if isinstance(source, io.BytesIO):
            source.seek(0)
        want = source if isinstance(source, np.ndarray) else load_audio(source, 16000)
        assert isinstance(out, np.ndarray) and np.array_equal(out, want)
    assert isinstance(got[-1], BadAudioError)


def test_transcripts_and_errors_match_serial_decoding() -> None:
    inputs = [SPEECH / name for name in CLIPS] + [b"junk" * 64]
    serial, parallel = engine(0), engine(2)
    try:
        a = serial.transcribe_outputs(inputs)
        b = parallel.transcribe_outputs(inputs)
        assert all(o.ok for o in a[:-1] + b[:-1]), [o.error for o in a + b]
        assert serial._decode_pool is None and parallel._decode_pool is not None
        assert [o.transcript.text for o in a[:-1]] == [o.transcript.text for o in b[:-1]]
        assert isinstance(b[-1].error, BadAudioError) and str(b[-1].error) == str(a[-1].error)
        # transcribe_offline raises the first input's error, as the serial path does
        with pytest.raises(BadAudioError):
            parallel.transcribe_offline(inputs)
        texts = [t.text for t in parallel.transcribe_offline(inputs[:-1])]
        assert texts == [o.transcript.text for o in a[:-1]]
    finally:
        serial.shutdown()
        parallel.shutdown()


def test_duration_limit_in_the_workers() -> None:
    eng = engine(2, max_audio_seconds=2.5)
    try:
        outs = eng.load_audios([SPEECH / CLIPS[0], SPEECH / CLIPS[1]])  # 2.0 s and 9.6 s
    finally:
        eng.shutdown()
    assert isinstance(outs[0], np.ndarray) and isinstance(outs[1], AudioTooLongError)


def test_one_file_is_decoded_here() -> None:
    eng = engine(4)
    try:
        (out,) = eng.load_audios([SPEECH / CLIPS[0]])
        assert isinstance(out, np.ndarray)
        assert eng._decode_pool is None  # starting processes for one file costs more than it saves
    finally:
        eng.shutdown()


def test_config_validation() -> None:
    from oasr.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError):
        EngineConfig(decode_processes=-1)


def test_cli_decode_processes_same_output(tmp_path: Path) -> None:
    """``oasr transcribe --decode-processes 2`` prints what decoding one by one prints (real
    tiny.en, two short clips)."""
    pytest.importorskip("oasr_models_whisper")
    from typer.testing import CliRunner

    from oasr.cli.main import app
    from oasr.defaults import default_checkpoint

    try:
        default_checkpoint()
    except Exception as exc:  # noqa: BLE001 - no default model on this machine
        pytest.skip(f"default model unavailable: {exc}")
    files = [str(SPEECH / "en_ls_2830-3980-0043.wav"), str(SPEECH / "en_ls_4507-16021-0012.wav")]
    runs = {}
    for n in ("0", "2"):
        res = CliRunner().invoke(
            app, ["transcribe", "--threads", "1", "-f", "json", "--decode-processes", n, *files]
        )
        assert res.exit_code == 0, res.output
        runs[n] = res.output
    assert runs["0"] == runs["2"] and runs["0"].count('"file"') == 2
    bad = CliRunner().invoke(app, ["transcribe", "--decode-processes", "-1", files[0]])
    assert bad.exit_code == 2

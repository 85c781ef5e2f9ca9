"""Whole-recording transcription through ``WhisperASR``: long-form seeking, word timestamps,
batching, no-speech, option validation. Parity against openai-whisper's ``transcribe``."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import (  # noqa: E402
    TINY_EN,
    load_speech,
    loaded_from_openai,
    openai_model_from_loaded,
    random_openai_model,
)

from oasr.errors import BadAudioError, InvalidRequestError, UnsupportedOptionError  # noqa: E402
from oasr.model import ASRModel  # noqa: E402
from oasr.types import DecodeFamily, DecodingOptions  # noqa: E402
from oasr_models_whisper.model import WhisperASR  # noqa: E402

whisper = pytest.importorskip("whisper")

FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
#: Parity with openai-whisper compares the decoding algorithm itself: openai-whisper has no VAD
#: gate, so the comparisons turn OASR's off (on these speech clips it would pass them through
#: unchanged anyway; test_speech_gate.py checks that).
NO_GATE = dict(vad_gate=False)


@pytest.fixture(scope="module")
def tiny_loaded():
    from oasr_models_whisper.checkpoints import load_ct2

    return load_ct2(TINY_EN)


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    return WhisperASR.from_loaded(tiny_loaded)


@pytest.fixture(scope="module")
def audio():
    return {
        "jfk": load_speech("en_jfk_inaugural.flac"),
        "long": load_speech("en_osr_us_000_0034_8k.wav"),
        "ls": load_speech("en_ls_1089-134686-0001.wav"),
    }


def assert_matches_reference(ours, ref, word_tol=0.0):
    """Our Transcript against openai-whisper's result dict (empty segments dropped)."""
    assert ours.text == ref["text"].strip()
    ref_segs = [s for s in ref["segments"] if s["text"].strip()]
    assert [s.text for s in ours.segments] == [s["text"] for s in ref_segs]
    for s, r in zip(ours.segments, ref_segs, strict=False):
        assert s.start == pytest.approx(r["start"], abs=1e-6)
        assert s.end == pytest.approx(r["end"], abs=1e-6)
        assert s.tokens == r["tokens"]
        assert s.seek == r["seek"]
        assert s.avg_logprob == pytest.approx(r["avg_logprob"], abs=1e-3)
        assert s.temperature == r["temperature"]
        ref_words = r.get("words", [])
        assert [w.word for w in s.words] == [w["word"] for w in ref_words]
        for w, rw in zip(s.words, ref_words, strict=False):
            assert abs(w.start - rw["start"]) <= word_tol + 1e-6
            assert abs(w.end - rw["end"]) <= word_tol + 1e-6
            assert w.confidence == pytest.approx(rw["probability"], abs=2e-3)


# --------------------------------------------------------------------------- basics
def test_protocol_and_capabilities(tiny):
    assert isinstance(tiny, ASRModel)
    assert tiny.name == "whisper tiny.en"
    caps = tiny.capabilities
    assert caps.decode_family == DecodeFamily.AED
    assert caps.word_timestamps and not caps.translation and not caps.language_detection
    assert tiny.feature_spec.kind == "whisper_logmel" and tiny.feature_spec.num_bins == 80


@pytest.mark.parametrize(
    "options,param",
    [
        (dict(task="translate"), "task"),
        (dict(language="de"), "language"),
        (dict(language="French"), "language"),
    ],
)
def test_english_only_refuses_other_languages_and_translation(tiny, options, param):
    with pytest.raises(UnsupportedOptionError, match="English-only") as info:
        tiny.transcribe([np.zeros(16000, np.float32)], DecodingOptions(**options))
    assert info.value.param == param


def test_invalid_requests(tiny):
    silence = [np.zeros(16000, np.float32)]
    with pytest.raises(InvalidRequestError, match="unknown language"):
        tiny.transcribe(silence, DecodingOptions(language="xx-klingon"))
    with pytest.raises(InvalidRequestError, match="length_penalty"):
        tiny.transcribe(silence, DecodingOptions.build(length_penalty=2.0))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        tiny.transcribe(silence, DecodingOptions(max_new_tokens=1000))
    with pytest.raises(InvalidRequestError, match="suppress_tokens"):
        tiny.transcribe(silence, DecodingOptions.build(suppress_tokens=(10**6,)))
    with pytest.raises(BadAudioError, match="mono"):
        tiny.transcribe([np.zeros((2, 16000), np.float32)], DecodingOptions())
    with pytest.raises(BadAudioError, match="NaN"):
        tiny.transcribe([np.full(16000, np.nan, np.float32)], DecodingOptions())
    # English by name is fine on an English-only model
    assert tiny.transcribe(silence, DecodingOptions(language="English"))[0].language == "en"


def test_silence_and_noise_yield_no_text(tiny):
    rng = np.random.default_rng(0)
    inputs = [
        np.zeros(16000 * 5, np.float32),
        np.zeros(16000 * 40, np.float32),  # long-form path too
        (rng.standard_normal(16000 * 8) * 0.01).astype(np.float32),
        (rng.standard_normal(16000 * 8) * 0.1).astype(np.float32),
        np.zeros(0, np.float32),
    ]
    out = tiny.transcribe(inputs, DecodingOptions(word_timestamps=True))
    for t, a in zip(out, inputs, strict=False):
        assert t.text == "" and t.segments == [] and t.words == []
        assert t.duration == pytest.approx(len(a) / 16000)
        assert t.language == "en"


def test_progress_reports_completion(tiny, audio):
    calls = []
    tiny.transcribe([audio["jfk"]], DecodingOptions.build(without_timestamps=True),
                    progress=lambda done, total: calls.append((done, total)))  # fmt: skip
    assert calls and calls[-1][0] == calls[-1][1] > 0


# --------------------------------------------------------------------------- parity, real tiny.en
@pytest.fixture(scope="module")
def tiny_ref(tiny_loaded):
    return openai_model_from_loaded(tiny_loaded)


@pytest.fixture(scope="module")
def batch_out(tiny, audio):
    return tiny.transcribe(
        [audio["long"], audio["jfk"], audio["ls"]],
        DecodingOptions.build(word_timestamps=True, temperature=FALLBACK, **NO_GATE),
    )


@pytest.mark.slow
@pytest.mark.parametrize("index,name", [(0, "long"), (1, "jfk"), (2, "ls")])
def test_long_form_and_words_match_openai_transcribe(batch_out, tiny_ref, audio, index, name):
    ref = tiny_ref.transcribe(audio[name], fp16=False, temperature=FALLBACK, word_timestamps=True)
    ours = batch_out[index]
    assert_matches_reference(ours, ref)
    if name == "long":
        # the 35.5 s clip is transcribed to its end: the last sentence is there
        assert ours.duration == pytest.approx(35.5, abs=0.1)
        assert ours.segments[-1].end > 33.0
        assert "bell" in ours.segments[-1].text
        assert len({s.seek for s in ours.segments}) >= 2  # more than one 30 s window


@pytest.mark.slow
def test_prompt_and_no_conditioning_match_openai(tiny, tiny_ref, audio):
    opts = DecodingOptions.build(
        prompt="Sentences from a hearing test.", condition_on_previous_text=False, **NO_GATE
    )
    ours = tiny.transcribe([audio["long"]], opts)[0]
    ref = tiny_ref.transcribe(audio["long"], fp16=False, temperature=0.0,
                              initial_prompt=opts.prompt, condition_on_previous_text=False)  # fmt: skip
    assert_matches_reference(ours, ref)


@pytest.mark.slow  # parity: a batch against each input alone
def test_batch_equals_single(tiny):
    a = load_speech("en_ls_2830-3980-0043.wav")
    b = load_speech("en_ls_4507-16021-0012.wav")
    both = tiny.transcribe([a, b], DecodingOptions())
    single = tiny.transcribe([b], DecodingOptions())[0]
    assert both[1].text == single.text
    assert [s.tokens for s in both[1].segments] == [s.tokens for s in single.segments]
    assert "experience" in both[0].text.lower() and "halt" in single.text.lower()


# --------------------------------------------------------------------------- random multilingual
@pytest.fixture(scope="module")
def rand_pair(tmp_path_factory):
    """A random-weight multilingual model as (ours on the real network, openai-whisper)."""
    ref = random_openai_model(multilingual=True, seed=3)
    loaded, tok = loaded_from_openai(ref, tmp_path_factory.mktemp("rand"))
    ours = WhisperASR.from_loaded(loaded)
    assert ours.tokenizer.languages == tok.languages
    return ours, ref


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        pytest.param(dict(task="translate", language="de"), marks=pytest.mark.slow),
        pytest.param(dict(word_timestamps=True, language="es"), marks=pytest.mark.slow),
    ],
    ids=["detect", "translate", "words"],
)
def test_random_multilingual_long_form_matches_openai(rand_pair, audio, kw):
    ours_model, ref_model = rand_pair
    opts = DecodingOptions.build(max_new_tokens=12, **kw, **NO_GATE)
    ours = ours_model.transcribe([audio["long"]], opts)[0]
    ref = ref_model.transcribe(audio["long"], fp16=False, temperature=0.0, sample_len=12,
                               language=kw.get("language"), task=kw.get("task", "transcribe"),
                               word_timestamps=kw.get("word_timestamps", False))  # fmt: skip
    assert ours.language == ref["language"]
    assert ours.task == opts.task
    assert_matches_reference(ours, ref)
    assert ours_model.capabilities.translation and ours_model.capabilities.language_detection


def test_multilingual_refuses_unknown_language(rand_pair):
    ours_model, _ = rand_pair
    with pytest.raises(UnsupportedOptionError, match="yue"):
        ours_model.transcribe([np.zeros(1600, np.float32)], DecodingOptions(language="yue"))


def test_native_round_trip(tiny, tmp_path, audio):
    assert tiny.save_native(tmp_path / "native") == "whisper"
    from oasr.checkpoint import read_native_config

    again = WhisperASR.from_native(tmp_path / "native", read_native_config(tmp_path / "native"))
    opts = DecodingOptions.build(without_timestamps=True)
    clip = load_speech("en_ls_2830-3980-0043.wav")
    text = again.transcribe([clip], opts)[0].text
    assert text == tiny.transcribe([clip], opts)[0].text
    assert "experience" in text.lower()
    assert again.name == tiny.name


@pytest.mark.slow
def test_word_timestamps_are_monotonic_and_inside_audio(batch_out):
    for t in batch_out:
        words = t.words
        assert words
        prev_end = 0.0
        for w in words:
            assert 0.0 <= w.start <= w.end <= t.duration + 0.05
            assert w.start >= prev_end - 1e-6
            assert 0.0 <= w.confidence <= 1.0
            prev_end = w.end


def test_openai_pt_checkpoint_without_tokenizer_files(tmp_path, audio):
    """An openai-whisper .pt ships no tokenizer; the standard one is rebuilt and decoding
    matches openai-whisper on the same file."""
    from dataclasses import asdict

    from oasr_models_whisper.checkpoints import load_openai

    ref = random_openai_model(multilingual=False, seed=5)
    pt = tmp_path / "random-weights.pt"
    torch.save({"dims": asdict(ref.dims), "model_state_dict": ref.state_dict()}, pt)
    loaded = load_openai(pt)
    assert not loaded.tokenizer_files
    ours = WhisperASR.from_loaded(loaded)
    heads = ours.network.alignment_heads.tolist()
    assert sorted(map(tuple, heads)) == sorted(
        map(tuple, ref.alignment_heads.to_dense().nonzero().tolist())
    )
    opts = DecodingOptions.build(max_new_tokens=12, word_timestamps=True, **NO_GATE)
    clip = load_speech("en_ls_2830-3980-0043.wav")
    got = ours.transcribe([clip], opts)[0]
    want = ref.transcribe(clip, fp16=False, temperature=0.0, sample_len=12,
                          word_timestamps=True)  # fmt: skip
    assert_matches_reference(got, want)


@pytest.mark.parametrize("piece", [1, 777, 3000])
def test_piecewise_log_mel_of_long_audio_is_identical(piece):
    from oasr_models_whisper.transcribe import whole_log_mel

    gen = torch.Generator().manual_seed(0)
    wave = torch.randn(16000 * 65 + 123, generator=gen) * 0.05
    wave[16000 * 20 : 16000 * 30] *= 20
    whole = whole_log_mel(wave, 80)
    pieces = whole_log_mel(wave, 80, piece_frames=piece, long_samples=0)
    assert whole.shape == pieces.shape
    torch.testing.assert_close(pieces, whole, atol=1e-6, rtol=0)

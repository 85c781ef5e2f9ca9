"""Real speech, real weights: tiny.en through OASR against faster-whisper (CTranslate2) on the
same checkpoint, greedy, no VAD. Corpus WER with Whisper's English normaliser; word timings."""

from __future__ import annotations

import difflib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fixtures_decoding import TINY_EN, load_speech, manifest  # noqa: E402

from oasr.types import DecodingOptions  # noqa: E402

jiwer = pytest.importorskip("jiwer")
faster_whisper = pytest.importorskip("faster_whisper")
normalizers = pytest.importorskip("whisper.normalizers")

pytestmark = pytest.mark.slow

WORD_CLIPS = [
    "en_jfk_inaugural.flac",
    "en_osr_us_000_0034_8k.wav",
    "en_ls_1089-134686-0001.wav",
    "en_ls_1272-141231-0002.mp3",
    "en_fleurs_002.ogg",
]


@pytest.fixture(scope="module")
def corpus():
    items = [m for m in manifest() if m["language"] == "en"]
    return [(m["audio"], m["text"], load_speech(m["audio"])) for m in items]


@pytest.fixture(scope="module")
def ours_model():
    from oasr_models_whisper.checkpoints import load_ct2
    from oasr_models_whisper.model import WhisperASR

    return WhisperASR.from_loaded(load_ct2(TINY_EN))


@pytest.fixture(scope="module")
def fw_model():
    return faster_whisper.WhisperModel(str(TINY_EN), device="cpu", compute_type="float32",
                                       cpu_threads=2)  # fmt: skip


def fw_transcribe(model, audio, word_timestamps=False):
    segments, _info = model.transcribe(
        audio, beam_size=1, temperature=0.0, vad_filter=False, language="en",
        word_timestamps=word_timestamps, condition_on_previous_text=True,
    )  # fmt: skip
    return list(segments)


def test_corpus_wer_matches_faster_whisper(corpus, ours_model, fw_model):
    norm = normalizers.EnglishTextNormalizer()
    # faster-whisper runs with vad_filter=False, so OASR's VAD gate is off too: no VAD either side
    ours = ours_model.transcribe(
        [a for _, _, a in corpus], DecodingOptions.build(beam_size=1, temperature=0.0, vad_gate=False)
    )
    refs, hyp_ours, hyp_fw = [], [], []
    for (name, ref, audio), t in zip(corpus, ours, strict=False):
        fw_text = "".join(s.text for s in fw_transcribe(fw_model, audio))
        refs.append(norm(ref))
        hyp_ours.append(norm(t.text))
        hyp_fw.append(norm(fw_text))
        if hyp_ours[-1] != hyp_fw[-1]:
            print(f"{name}\n  ours: {hyp_ours[-1]}\n  fw:   {hyp_fw[-1]}")
    wer_ours = jiwer.wer(refs, hyp_ours) * 100
    wer_fw = jiwer.wer(refs, hyp_fw) * 100
    print(
        f"\ncorpus WER on {len(refs)} English clips: OASR {wer_ours:.2f}%  faster-whisper {wer_fw:.2f}%"
    )
    assert abs(wer_ours - wer_fw) <= 0.5
    assert wer_ours < 15.0
    # the 35.5 s clip is transcribed to its end
    long = [
        t
        for (name, _, _), t in zip(corpus, ours, strict=False)
        if name == "en_osr_us_000_0034_8k.wav"
    ][0]
    assert "quickly" in long.text.lower() and long.segments[-1].end > 33.0


def _match_words(ours_words, fw_words):
    """Pairs of (ours, faster-whisper) words with the same normalised spelling, in order."""
    key = lambda w: "".join(ch for ch in w.lower() if ch.isalnum())  # noqa: E731
    a = [key(w.word) for w in ours_words]
    b = [key(w.word) for w in fw_words]
    pairs = []
    for block in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks():
        for k in range(block.size):
            pairs.append((ours_words[block.a + k], fw_words[block.b + k]))
    return pairs


def test_word_timestamps_match_faster_whisper(corpus, ours_model, fw_model):
    chosen = [(n, a) for n, _, a in corpus if n in WORD_CLIPS]
    ours = ours_model.transcribe(
        [a for _, a in chosen], DecodingOptions.build(word_timestamps=True, vad_gate=False)
    )
    worst = 0.0
    n_pairs = n_words = 0
    for (name, audio), t in zip(chosen, ours, strict=False):
        duration = len(audio) / 16000
        words = t.words
        assert words, name
        prev = 0.0
        for w in words:  # within the audio, monotonic
            assert 0.0 <= w.start <= w.end <= duration + 0.05, (name, w)
            assert w.start >= prev - 1e-6, (name, w)
            prev = w.end
        fw_words = [w for s in fw_transcribe(fw_model, audio, True) for w in s.words]
        pairs = _match_words(words, fw_words)
        n_pairs += len(pairs)
        n_words += len(words)
        dev = max(max(abs(o.start - f.start), abs(o.end - f.end)) for o, f in pairs)
        print(f"{name}: {len(pairs)}/{len(words)} words matched, max deviation {dev:.3f} s")
        worst = max(worst, dev)
    print(f"max word-timestamp deviation vs faster-whisper: {worst:.3f} s over {n_pairs} words")
    assert n_pairs >= 0.9 * n_words
    assert worst <= 0.3

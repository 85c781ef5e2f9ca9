"""oasr.vad segmentation against silero_vad.get_speech_timestamps, on the same probabilities."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _vad_helpers import FILE_8K, FILES_16K, read
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.errors import InvalidRequestError
from oasr.vad import (
    SegmentationOptions,
    SpeechSegment,
    StreamingSegmenter,
    get_speech_segments,
    segments_from_probs,
)

# (our options, silero-vad keyword arguments) pairs
CONFIGS = [
    ({}, {}),
    ({"threshold": 0.3}, {"threshold": 0.3}),
    ({"threshold": 0.7, "neg_threshold": 0.6}, {"threshold": 0.7, "neg_threshold": 0.6}),
    ({"min_speech_ms": 500, "min_silence_ms": 300, "speech_pad_ms": 100},
     {"min_speech_duration_ms": 500, "min_silence_duration_ms": 300, "speech_pad_ms": 100}),
    ({"min_silence_ms": 0, "speech_pad_ms": 0, "min_speech_ms": 0},
     {"min_silence_duration_ms": 0, "speech_pad_ms": 0, "min_speech_duration_ms": 0}),
    ({"max_speech_s": 2.0}, {"max_speech_duration_s": 2.0}),
    ({"max_speech_s": 1.5, "min_silence_ms": 500, "speech_pad_ms": 200},
     {"max_speech_duration_s": 1.5, "min_silence_duration_ms": 500, "speech_pad_ms": 200}),
    ({"max_speech_s": 3.0, "split_at_longest_silence": False, "min_silence_ms": 400},
     {"max_speech_duration_s": 3.0, "use_max_poss_sil_at_max_speech": False,
      "min_silence_duration_ms": 400}),
]


def _pairs(segs: list[SpeechSegment]) -> list[tuple[int, int]]:
    return [(s.start, s.end) for s in segs]


def _theirs(ts: list[dict]) -> list[tuple[int, int]]:
    return [(int(d["start"]), int(d["end"])) for d in ts]


@pytest.mark.parametrize("name", [*FILES_16K, FILE_8K])
@pytest.mark.parametrize("ours,theirs", CONFIGS, ids=[str(i) for i in range(len(CONFIGS))])
def test_same_as_get_speech_timestamps_on_real_speech(
    jit_model, ref_probs, silero_utils, name, ours, theirs
):
    x, sr, probs = ref_probs(name)
    # silero-vad computes the probabilities itself with its JIT model (the same ones as probs)
    expected = silero_utils.get_speech_timestamps(
        torch.from_numpy(x), jit_model, sampling_rate=sr, **theirs
    )
    assert expected  # there is speech
    opts = SegmentationOptions(**ours)
    window = 512 if sr == 16000 else 256
    got = segments_from_probs(probs, sr, window, opts, len(x))
    assert _pairs(got) == _theirs(expected)
    # streaming, in uneven groups of windows
    seg = StreamingSegmenter(sr, window, opts)
    out: list[SpeechSegment] = []
    for i in range(0, len(probs), 7):
        out += seg.push(probs[i : i + 7])
    out += seg.finish(len(x))
    assert _pairs(out) == _theirs(expected)


@pytest.mark.parametrize("name", [FILES_16K[1], FILE_8K])
def test_end_to_end_with_oasr_detector(vad, jit_model, silero_utils, name):
    x, sr = read(name)
    expected = silero_utils.get_speech_timestamps(torch.from_numpy(x), jit_model, sampling_rate=sr)
    got = get_speech_segments(x, sr, vad)
    assert _pairs(got) == _theirs(expected)
    assert all(s.sample_rate == sr for s in got)


def test_multiple_of_16k_is_decimated_like_silero(vad, jit_model, silero_utils):
    from _vad_helpers import SPEECH

    from oasr.audio import load_audio

    x = load_audio(str(SPEECH / FILES_16K[0]), 48000)
    with pytest.warns(UserWarning):
        expected = silero_utils.get_speech_timestamps(
            torch.from_numpy(x), jit_model, sampling_rate=48000
        )
    got = get_speech_segments(x, 48000, vad)
    assert _pairs(got) == _theirs(expected)
    assert got[0].sample_rate == 48000


def test_other_rates_are_resampled(vad):
    from _vad_helpers import SPEECH

    from oasr.audio import load_audio

    x16 = load_audio(str(SPEECH / FILES_16K[0]), 16000)
    x22 = load_audio(str(SPEECH / FILES_16K[0]), 22050)
    a = get_speech_segments(x16, 16000, vad)
    b = get_speech_segments(x22, 22050, vad)
    assert len(a) == len(b)
    for s, t in zip(a, b, strict=False):
        assert abs(s.start_s - t.start_s) < 0.05 and abs(s.end_s - t.end_s) < 0.05


# -- random probability sequences: every branch, including max-speech splits ------------------

_level = st.sampled_from([0.0, 0.05, 0.2, 0.34, 0.35, 0.36, 0.49, 0.5, 0.51, 0.8, 1.0])


@st.composite
def _probs(draw):
    runs = draw(st.lists(st.tuples(_level, st.integers(1, 40)), max_size=25))
    return [v for v, n in runs for _ in range(n)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    probs=_probs(),
    sr=st.sampled_from([8000, 16000]),
    threshold=st.sampled_from([0.3, 0.5, 0.5, 0.7]),
    neg=st.sampled_from([None, None, 0.2, 0.45]),
    min_speech=st.sampled_from([0, 100, 250, 600]),
    min_silence=st.sampled_from([0, 50, 100, 300]),
    pad=st.sampled_from([0, 30, 30, 100, 500]),
    max_speech=st.sampled_from([math.inf, math.inf, 0.5, 1.0, 2.5]),
    sil_at_max=st.sampled_from([98, 10, 300]),
    longest=st.booleans(),
    short_tail=st.integers(0, 255),
    groups=st.lists(st.integers(1, 60), min_size=1, max_size=8),
)
def test_matches_silero_on_random_probabilities(
    silero_utils, probs, sr, threshold, neg, min_speech, min_silence, pad, max_speech,
    sil_at_max, longest, short_tail, groups,
):
    window = 512 if sr == 16000 else 256
    length = max(0, len(probs) * window - short_tail)
    expected = silero_utils.get_speech_timestamps_from_probs(
        list(probs), sampling_rate=sr, threshold=threshold, neg_threshold=neg,
        min_speech_duration_ms=min_speech, min_silence_duration_ms=min_silence,
        speech_pad_ms=pad, max_speech_duration_s=max_speech,
        min_silence_at_max_speech=sil_at_max, use_max_poss_sil_at_max_speech=longest,
        audio_length_samples=length,
    )
    opts = SegmentationOptions(
        threshold=threshold, neg_threshold=neg, min_speech_ms=min_speech,
        min_silence_ms=min_silence, speech_pad_ms=pad, max_speech_s=max_speech,
        min_silence_at_max_speech_ms=sil_at_max, split_at_longest_silence=longest,
    )
    assert _pairs(segments_from_probs(probs, sr, window, opts, length)) == _theirs(expected)
    seg = StreamingSegmenter(sr, window, opts)
    out: list[SpeechSegment] = []
    i = k = 0
    while i < len(probs):
        n = groups[k % len(groups)]
        out += seg.push(probs[i : i + n])
        i, k = i + n, k + 1
    out += seg.finish(length)
    assert _pairs(out) == _theirs(expected)


def test_segments_are_emitted_early():
    """A segment is released once no later one can come within 2 * pad of its end."""
    sr, w = 16000, 512
    seg = StreamingSegmenter(sr, w, SegmentationOptions(speech_pad_ms=30))
    probs = [0.0] * 5 + [0.9] * 20 + [0.0] * 10
    out = seg.push(probs)
    assert len(out) == 1  # released well before the end of the stream
    assert out == segments_from_probs(probs + [0.0] * 50, sr, w)[:1]
    assert seg.finish() == []


def test_options_validation_and_defaults():
    o = SegmentationOptions()
    assert o.exit_threshold == pytest.approx(0.35)
    assert SegmentationOptions(threshold=0.1).exit_threshold == 0.01
    assert SegmentationOptions(threshold=0.6, neg_threshold=0.2).exit_threshold == 0.2
    with pytest.raises(InvalidRequestError):
        SegmentationOptions(threshold=1.5)
    with pytest.raises(InvalidRequestError):
        SegmentationOptions(min_silence_ms=-1)
    with pytest.raises(InvalidRequestError):
        SegmentationOptions(max_speech_s=0)
    s = SpeechSegment(8000, 24000, 16000)
    assert (s.start_s, s.end_s, s.duration_s) == (0.5, 1.5, 1.0)
    assert s.to_dict() == {"start": 8000, "end": 24000, "start_s": 0.5, "end_s": 1.5}
    assert segments_from_probs([], 16000, 512) == []
    assert segments_from_probs(np.ones(10), 16000, 512) == [SpeechSegment(0, 5120, 16000)]

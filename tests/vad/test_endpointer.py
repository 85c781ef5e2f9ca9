"""Streaming endpointer: events do not depend on how the audio is chunked."""

from __future__ import annotations

import numpy as np
import pytest
from _vad_helpers import FILE_8K, SPEECH, read
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.errors import InvalidRequestError
from oasr.vad import (
    Endpointer,
    SegmentationOptions,
    VADEvent,
    get_speech_segments,
    segments_from_probs,
)


def _chunks(x: np.ndarray, sizes: list[int]):
    i = k = 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        yield x[i : i + n]
        i, k = i + n, k + 1


def _one_two_three() -> tuple[np.ndarray, int]:
    from oasr.audio import load_audio

    return load_audio(str(SPEECH / "en_sr_one_two_three.wav"), 16000), 16000


def _speech_then_silence() -> tuple[np.ndarray, int]:
    x, sr = _one_two_three()
    return np.concatenate([np.zeros(4000, np.float32), x, np.zeros(sr, np.float32), x[:8000]]), sr


@pytest.fixture(scope="module")
def clip():
    return _speech_then_silence()


@pytest.fixture(scope="module")
def reference_events(vad, clip):
    x, sr = clip
    return Endpointer(vad, sr, end_silence_ms=300).run([x])


def test_events_are_consistent(vad, clip, reference_events):
    x, sr = clip
    ev = reference_events
    kinds = [e.kind for e in ev if e.kind != "segment"]
    assert kinds[0] == "speech_start" and kinds[-1] == "speech_end"
    # starts and ends alternate
    assert all(a != b for a, b in zip(kinds, kinds[1:], strict=False))
    starts = [e for e in ev if e.kind == "speech_start"]
    ends = [e for e in ev if e.kind == "speech_end"]
    assert len(starts) == len(ends) >= 2
    for e in ev:
        assert e.emitted_at >= e.sample and e.sample_rate == sr
    # a turn ends end_silence_ms after speech stops (to a window), not at end of stream
    inner = [e for e in ends if e.emitted_at < len(x)]
    assert inner
    for e in inner:
        lag = (e.emitted_at - e.sample) / sr
        assert 0.3 <= lag <= 0.3 + 512 / sr + 1e-9
    # segments equal the offline segmentation of the same audio
    segs = [e.segment for e in ev if e.kind == "segment"]
    assert segs == get_speech_segments(x, sr, vad)
    assert all(e.sample == e.segment.start for e in ev if e.kind == "segment")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 9000), min_size=1, max_size=6))
def test_any_chunking_gives_the_same_events(vad, clip, reference_events, sizes):
    x, sr = clip
    ep = Endpointer(vad, sr, end_silence_ms=300)
    events: list[VADEvent] = []
    for chunk in _chunks(x, sizes):
        events += ep.feed(chunk)
    events += ep.finish()
    assert events == reference_events


def test_8k_stream_and_segments(vad):
    x, sr = read(FILE_8K)
    x = x[: sr * 12]
    ep = Endpointer(vad, sr, end_silence_ms=500)
    events = ep.run(_chunks(x, [800, 3, 2000]))
    assert len(ep.probs) == -(-len(x) // 256)
    segs = [e.segment for e in events if e.kind == "segment"]
    assert segs == segments_from_probs(ep.probs, sr, 256, audio_length=len(x))
    assert len(segs) >= 2
    assert any(e.kind == "speech_end" for e in events)


def test_open_turn_is_closed_at_end_of_stream(vad):
    x, sr = _one_two_three()
    ep = Endpointer(vad, sr, end_silence_ms=5000)
    events = ep.run([x[:20000]])
    ends = [e for e in events if e.kind == "speech_end"]
    assert len(ends) == 1 and ends[0].emitted_at == 20000
    with pytest.raises(ValueError):
        ep.feed(x[:10])


def test_endpointer_refuses_other_rates(vad):
    with pytest.raises(InvalidRequestError):
        Endpointer(vad, 44100)


# -- a deterministic toy detector: many more shapes of speech and silence -----------------------

class ToyDetector:
    """P(speech) = the window's mean value clipped to [0, 1] (audio *is* the probability)."""

    sample_rates = (16000,)

    def window_size(self, sample_rate: int = 16000) -> int:
        return 160

    def speech_probs(self, audio, sample_rate: int = 16000) -> np.ndarray:
        x = np.asarray(audio, np.float32)
        x = np.concatenate([x, np.zeros((-len(x)) % 160, np.float32)])
        return np.clip(x.reshape(-1, 160).mean(axis=1), 0, 1)

    def new_state(self, sample_rate: int = 16000) -> dict:
        return {"buf": np.zeros(0, np.float32)}

    def step(self, state, chunk, *, final: bool = False) -> np.ndarray:
        buf = np.concatenate([state["buf"], np.asarray(chunk, np.float32)])
        k = len(buf) // 160
        if final and len(buf) % 160:
            k += 1
        done = buf[: k * 160]
        state["buf"] = buf[k * 160 :]
        return self.speech_probs(done) if k else np.zeros(0, np.float32)


@st.composite
def _toy_audio(draw):
    runs = draw(st.lists(st.tuples(st.sampled_from([0.0, 0.2, 0.4, 0.6, 1.0]),
                                   st.integers(1, 60)), min_size=1, max_size=15))
    x = np.concatenate([np.full(n * 160, v, np.float32) for v, n in runs])
    return x[: len(x) - draw(st.integers(0, 159))]


@settings(max_examples=150, deadline=None)
@given(
    x=_toy_audio(),
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=5),
    end_ms=st.sampled_from([50, 200, 1000]),
    max_s=st.sampled_from([float("inf"), 0.3, 1.0]),
    pad=st.sampled_from([0, 30, 200]),
)
def test_toy_any_chunking_same_events_and_offline_segments(x, sizes, end_ms, max_s, pad):
    det = ToyDetector()
    opts = SegmentationOptions(max_speech_s=max_s, speech_pad_ms=pad, min_speech_ms=50)
    whole = Endpointer(det, 16000, opts, end_silence_ms=end_ms).run([x])
    chunked = Endpointer(det, 16000, opts, end_silence_ms=end_ms).run(_chunks(x, sizes))
    assert chunked == whole
    segs = [e.segment for e in whole if e.kind == "segment"]
    assert segs == segments_from_probs(det.speech_probs(x), 16000, 160, opts, len(x))
    turns = [e.kind for e in whole if e.kind != "segment"]
    assert turns == ["speech_start", "speech_end"] * (len(turns) // 2)

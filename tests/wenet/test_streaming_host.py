"""The host side of WeNet's batched streaming step: the vectorised greedy advance equals the
one-row search, partial texts built from new tokens only equal a full decode, final transcripts
carry words exactly when asked, and the per-phase step profile accounts for every step."""

from __future__ import annotations

import numpy as np
import pytest

from oasr.decoders.ctc import CTCGreedySearch
from oasr.stream_cache import StepProfile
from oasr.types import DecodingOptions
from oasr_models_wenet.model import Units, _greedy_advance

CLIP = "zh_aishell_BAC009S0764W0121.wav"


@pytest.mark.parametrize("seed", range(6))
def test_greedy_advance_equals_one_row_search(seed) -> None:
    """Chunks of random best paths (blank-heavy, repeated tokens, runs across chunk edges,
    short and empty rows, tied values) through the batched advance and through
    ``CTCGreedySearch._advance`` row by row: identical hypotheses, scores and state."""
    rng = np.random.default_rng(seed)
    b, blank = 9, 0
    batched = [CTCGreedySearch(blank) for _ in range(b)]
    reference = [CTCGreedySearch(blank) for _ in range(b)]
    for _ in range(7):
        t = int(rng.integers(1, 12))
        toks = rng.choice([0, 0, 0, 1, 2, 3, 7], size=(b, t)).astype(np.int64)
        repeat = rng.random((b, t)) < 0.4  # long runs of one token, also across chunks
        for j in range(1, t):
            toks[:, j] = np.where(repeat[:, j], toks[:, j - 1], toks[:, j])
        vals = -rng.integers(0, 6, size=(b, t)).astype(np.float64) / 4  # ties on purpose
        lens = rng.integers(0, t + 1, size=b)
        lens[0] = t
        _greedy_advance(batched, vals, toks, lens, blank)
        for r in range(b):
            n = int(lens[r])
            reference[r]._advance(vals[r, :n].tolist(), toks[r, :n].tolist())
        for x, y in zip(batched, reference, strict=True):
            assert (x.hyp.tokens, x.hyp.times, x.hyp.token_logprobs) == (y.hyp.tokens, y.hyp.times, y.hyp.token_logprobs)
            assert (x.hyp.score, x.prev, x.frame) == (y.hyp.score, y.prev, y.frame)
            assert all(type(v) is int for v in x.hyp.tokens + x.hyp.times)
            assert all(type(v) is float for v in x.hyp.token_logprobs)
    assert sum(len(s.hyp.tokens) for s in batched) > 10  # the case was not trivial


def test_units_join_is_decode_in_pieces() -> None:
    units = Units(["<blank>", "\u2581he", "llo", "\u2581wor", "ld", "好", "<eos>"])
    ids = [1, 2, 3, 4, 5, 9, 0, 1]  # 9: not in the table
    for cut in range(len(ids) + 1):
        assert units.clean(units.join(ids[:cut]) + units.join(ids[cut:])) == units.decode(ids)
    assert units.decode(ids) == "hello world好<9><blank> he"
    assert units.decode([]) == ""


def test_partials_final_words_and_step_profile(u2pp, speech) -> None:
    """Each greedy partial equals a full decode of the hypothesis so far; the final transcript
    has words only with ``word_timestamps``; the step profile counts every step and row."""
    audio = speech[CLIP][:48000]
    prof = StepProfile()
    u2pp.stream_profile = prof
    try:
        states = [u2pp.new_stream(DecodingOptions(beam_size=1, word_timestamps=w), chunk_size=4) for w in (True, False)]
        steps = rows = 0
        finals = {}
        for k in range(0, len(audio), 5120):
            last = k + 5120 >= len(audio)
            ups = u2pp.stream_step(states, [audio[k : k + 5120]] * 2, [last, last])
            steps, rows = steps + 1, rows + 2
            for i, (st, up) in enumerate(zip(states, ups, strict=True)):
                if up.is_final:
                    finals[i] = up.transcript
                else:
                    assert up.text == u2pp.units.decode(st.search.hyp.tokens)
    finally:
        u2pp.stream_profile = None
    with_words, without = finals[0], finals[1]
    assert with_words.text == without.text and with_words.text
    assert with_words.segments[0].words and not without.segments[0].words
    assert with_words.segments[0].tokens == without.segments[0].tokens
    assert (prof.steps, prof.rows) == (steps, rows)
    assert prof.calls >= steps  # the last step also encodes the remainder
    assert set(prof.seconds) == set(StepProfile.PHASES)
    assert all(v >= 0 for v in prof.seconds.values()) and prof.seconds["encoder"] > 0
    report = prof.as_dict()
    assert report["steps"] == steps and report["us_per_row"]["encoder"] > 0
    assert prof.finals == 2 and prof.seconds["finals"] > 0


def test_stream_audio_pieces_read_like_one_array() -> None:
    """A stream's audio kept as the pieces it was fed in: windows copied out of them and
    samples dropped from the front equal the same operations on the joined array."""
    from oasr_models_wenet.model import WenetStreamState

    rng = np.random.default_rng(0)
    st = WenetStreamState(options=None, chunk_size=4, num_left_chunks=-1, window=19, stride=16,
                          win_length=400, hop_length=160, search=None)  # fmt: skip
    ref = np.zeros(0, np.float32)
    for _ in range(40):
        a = rng.standard_normal(int(rng.integers(1, 700))).astype(np.float32)
        st.pieces.append(a)
        ref = np.concatenate([ref, a])
        lo, n = int(rng.integers(0, ref.size + 5)), int(rng.integers(0, 900))
        dst = np.full(n, np.nan, np.float32)
        got = st.copy_audio(lo, dst)
        assert got == min(n, max(0, ref.size - lo))
        np.testing.assert_array_equal(dst[:got], ref[lo : lo + got])
        assert np.isnan(dst[got:]).all()  # nothing written past the audio
        k = int(rng.integers(0, 600))
        st.drop_audio(k)
        ref = ref[k:]
        np.testing.assert_array_equal(np.concatenate(st.pieces) if st.pieces else np.zeros(0, np.float32), ref)

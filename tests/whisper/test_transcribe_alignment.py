"""Word-alignment building blocks against openai-whisper's timing.py."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from oasr_models_whisper.alignment import (
    APPEND_PUNCTUATIONS,
    PREPEND_PUNCTUATIONS,
    WordTiming,
    dtw,
    median_filter,
    merge_punctuations,
)

timing = pytest.importorskip("whisper.timing")


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (5, 40), (30, 200), (64, 700)])
@pytest.mark.parametrize("ties", [False, True])
def test_dtw_matches_reference(shape, ties):
    rng = np.random.default_rng(shape[0] * 1000 + shape[1])
    x = rng.normal(size=shape)
    if ties:
        x = np.round(x)  # many equal costs exercise the tie-breaking order
    ours = dtw(x)
    ref = timing.dtw_cpu(x.astype(np.float64))
    np.testing.assert_array_equal(ours[0], ref[0])
    np.testing.assert_array_equal(ours[1], ref[1])


@pytest.mark.parametrize("frames", [2, 3, 4, 10, 301])
def test_median_filter_matches_reference(frames):
    x = torch.randn(3, 9, frames)
    torch.testing.assert_close(median_filter(x, 7), timing.median_filter(x, 7))


def test_merge_punctuations_matches_reference():
    words = [' "', " Hello", ",", " (", "world", ")", " it's", " ok", ".", '"']
    ours = [WordTiming(w, [i], i * 0.1, i * 0.1 + 0.1, 0.5) for i, w in enumerate(words)]
    ref = [timing.WordTiming(w, [i], i * 0.1, i * 0.1 + 0.1, 0.5) for i, w in enumerate(words)]
    ref = copy.deepcopy(ref)
    merge_punctuations(ours, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    timing.merge_punctuations(ref, PREPEND_PUNCTUATIONS, APPEND_PUNCTUATIONS)
    assert [(w.word, w.tokens) for w in ours] == [(w.word, w.tokens) for w in ref]

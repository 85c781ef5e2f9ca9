"""Synthetic CTC log-probabilities for tests and benchmarks: peaky frames that spell random words
of a lexicon (each token held 1-3 frames, blanks between), with noise, so that a search over a
real graph behaves as it does on a trained model's output."""

from __future__ import annotations

import numpy as np


def peaky_log_probs(token_ids: list[list[int]], num_frames: int, num_tokens: int,
                    rng: np.random.Generator, peak: float = 6.0, noise: float = 1.5) -> np.ndarray:  # fmt: skip
    """[num_frames, num_tokens] float32 log-softmax rows. ``token_ids``: pronunciations (token
    ids, blank = 0 excluded) to draw words from."""
    target = np.zeros(num_frames, dtype=np.int64)  # blank
    t = int(rng.integers(0, 4))
    while t < num_frames:
        for tok in token_ids[int(rng.integers(len(token_ids)))]:
            hold = int(rng.integers(1, 4))
            target[t:t + hold] = tok
            t += hold + int(rng.integers(1, 3))  # blank(s) after each token
            if t >= num_frames:
                break
        t += int(rng.integers(0, 4))
    logits = rng.normal(0.0, noise, size=(num_frames, num_tokens))
    logits[np.arange(num_frames), target] += peak
    logits -= logits.max(axis=1, keepdims=True)
    out = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return out.astype(np.float32)

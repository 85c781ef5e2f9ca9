"""oasr.features.batching.padded_batch: the one way families move a batch of waveforms to the
model's device (zero-padded, lengths beside it)."""

import numpy as np
import pytest
import torch

from oasr.errors import InvalidRequestError
from oasr.features.batching import padded_batch


def _waves(seed: int, sizes: list[int]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for n in sizes]


def _expected(waves: list[np.ndarray]) -> np.ndarray:
    out = np.zeros((len(waves), max(len(w) for w in waves)), np.float32)
    for i, w in enumerate(waves):
        out[i, : len(w)] = w
    return out


def test_cpu_batch_is_zero_padded_with_lengths():
    waves = _waves(0, [5, 17, 1, 9])
    x, lens = padded_batch(waves, "cpu")
    assert x.dtype == torch.float32 and lens.dtype == torch.long
    assert np.array_equal(x.numpy(), _expected(waves))
    assert lens.tolist() == [5, 17, 1, 9]
    with pytest.raises(InvalidRequestError):
        padded_batch([], "cpu")


@pytest.mark.gpu
def test_cuda_batches_reuse_the_pinned_buffer_without_leaking_old_samples():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # a long batch, then shorter and narrower ones through the same staging buffer: stale
    # samples of the earlier batch must never show up as padding
    for seed, sizes in enumerate([[48000, 16000, 32000], [100, 7, 64], [5000] * 9, [3, 48000]]):
        waves = _waves(seed, sizes)
        x, lens = padded_batch(waves, "cuda")
        assert x.device.type == "cuda" and lens.device.type == "cuda"
        assert np.array_equal(x.cpu().numpy(), _expected(waves))
        assert lens.tolist() == sizes

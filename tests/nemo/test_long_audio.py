"""Long audio: no length cap. Local attention (each frame sees the frames at most ``w`` away, one
block of queries at a time, memory linear in the length) equals the same context as a dense mask
and, when the window covers the input, full attention; a 10-minute input is transcribed with it
(the auto mode switches past ``full_attention_max_frames``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from oasr.types import DecodingOptions

from .conftest import SR  # noqa: TID252

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(hf_checkpoints):
    from oasr_models_nemo.model import NemoASR

    return {k: NemoASR.from_hf(hf_checkpoints[k].path) for k in ("ctc", "tdt")}


def _noise(seconds: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = int(seconds * SR)
    env = 0.05 + 0.2 * np.abs(np.sin(np.linspace(0, 3 * seconds, n)))
    return (rng.standard_normal(n) * env).astype(np.float32)


def test_local_attention_equals_dense_masks(models, waves) -> None:
    model = models["ctc"]
    enc = model.net.encoder
    long = _noise(70.0, 1)  # 875 encoder frames: several query blocks
    feats, flens = model.features([long, waves[0]])
    with torch.no_grad():
        for w in (5, 40):
            local, lens = enc(feats, flens, local_window=w)
            dense, _ = enc(feats, flens, att_context=(w, w))
            for b, n in enumerate(lens.tolist()):
                torch.testing.assert_close(local[b, :n], dense[b, :n], atol=1e-4, rtol=1e-4)
        # a window wider than the input is full attention
        local, lens = enc(feats, flens, local_window=2000)
        full, _ = enc(feats, flens)
        for b, n in enumerate(lens.tolist()):
            torch.testing.assert_close(local[b, :n], full[b, :n], atol=1e-4, rtol=1e-4)


def test_ten_minute_input(models) -> None:
    wave = _noise(600.0, 2)
    texts = {}
    for kind, model in models.items():
        out = model.transcribe([wave], DecodingOptions(word_timestamps=True))[0]
        texts[kind] = out.text
        assert out.duration == pytest.approx(600.0)
        words = out.words
        assert len(words) > 100, kind
        assert words[-1].end > 590.0 and words[-1].end <= 600.0, kind
        assert all(a.start <= b.start for a, b in zip(words, words[1:], strict=False)), kind
    # the auto mode used local attention (the full-attention limit is 6000 frames = 8 minutes):
    # the same as asking for it
    local = models["ctc"].transcribe([wave], DecodingOptions(
        model_options={"local_attention_window": 256}))[0].text
    assert texts["ctc"] == local


def test_nemotron_long_input_blockwise_equals_dense(hf_checkpoints, waves) -> None:
    """A chunked-limited model encodes long inputs block-wise with its own context: the same
    frames as its dense mask."""
    from oasr_models_nemo.model import NemoASR

    model = NemoASR.from_hf(hf_checkpoints["nemotron"].path)
    enc = model.net.encoder
    feats, flens = model.features([_noise(40.0, 3), waves[1]])
    with torch.no_grad():
        dense, lens = enc(feats, flens)
        old = enc.dense_limit
        enc.dense_limit = 0
        try:
            blockwise, _ = enc(feats, flens)
        finally:
            enc.dense_limit = old
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(blockwise[b, :n], dense[b, :n], atol=1e-4, rtol=1e-4)

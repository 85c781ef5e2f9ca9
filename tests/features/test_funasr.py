"""FunASR fbank + LFR + CMVN against a literal re-statement of FunASR's WavFrontend semantics
(fbank from kaldi-native-fbank with FunASR's settings; LFR and CMVN as plain loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from _feat_helpers import MAX_TOL, knf_fbank

from oasr.errors import CheckpointError
from oasr.features.funasr import FunASRFbankLFR, load_am_mvn, parse_am_mvn
from oasr.types import FeatureSpec


def ref_lfr(feats: np.ndarray, m: int, n: int) -> np.ndarray:
    """Frame loop as FunASR documents it: replicate the first frame (m-1)//2 times on the left;
    a last output that runs off the end is completed with copies of the last frame."""
    T = feats.shape[0]
    t_lfr = math.ceil(T / n)
    left = (m - 1) // 2
    padded = [feats[0]] * left + list(feats)
    T2 = T + left
    out = []
    for i in range(t_lfr):
        if m <= T2 - i * n:
            out.append(np.concatenate(padded[i * n : i * n + m]))
        else:
            frame = list(padded[i * n :])
            frame += [padded[-1]] * (m - (T2 - i * n))
            out.append(np.concatenate(frame))
    return np.stack(out) if out else np.zeros((0, feats.shape[1] * m), np.float32)


def write_am_mvn(path, shift, rescale):
    d = len(shift)
    fmt = " ".join
    path.write_text(
        "<Nnet>\n"
        f"<Splice> {d} {d}\n[ 0 ]\n"
        f"<AddShift> {d} {d}\n<LearnRateCoef> 0 [ {fmt(f'{v:.6f}' for v in shift)} ]\n"
        f"<Rescale> {d} {d}\n<LearnRateCoef> 0 [ {fmt(f'{v:.6f}' for v in rescale)} ]\n"
        "</Nnet>\n"
    )


@pytest.fixture
def am_mvn(tmp_path):
    rng = np.random.default_rng(0)
    shift = -rng.uniform(5, 15, 560).astype(np.float32)
    rescale = rng.uniform(0.1, 0.5, 560).astype(np.float32)
    p = tmp_path / "am.mvn"
    write_am_mvn(p, shift, rescale)
    return p, shift, rescale


@pytest.mark.parametrize("m,n", [(7, 6), (1, 1), (5, 3), (4, 1), (2, 4)])
def test_lfr_matches_reference_loop(m, n):
    rng = np.random.default_rng(m * 10 + n)
    fe = FunASRFbankLFR(FeatureSpec(kind="funasr_fbank_lfr", options={"lfr_m": m, "lfr_n": n}))
    for T in (1, 2, 5, 6, 7, 13, 50):
        feats = rng.standard_normal((T, 3)).astype(np.float32)
        got, lens = fe.lfr(torch.from_numpy(feats)[None], torch.tensor([T]))
        want = ref_lfr(feats, m, n)
        assert int(lens[0]) == want.shape[0]
        np.testing.assert_array_equal(got[0].numpy(), want)


def test_am_mvn_parsing(am_mvn):
    p, shift, rescale = am_mvn
    c = load_am_mvn(p)
    np.testing.assert_allclose(c[0], shift, atol=1e-6)
    np.testing.assert_allclose(c[1], rescale, atol=1e-6)
    with pytest.raises(CheckpointError, match="AddShift"):
        parse_am_mvn("<Nnet>\n</Nnet>\n")
    with pytest.raises(CheckpointError):
        load_am_mvn(p.parent / "nope.mvn")


def test_full_pipeline_matches_reference(speech, am_mvn):
    p, shift, rescale = am_mvn
    fe = FunASRFbankLFR(FeatureSpec(kind="funasr_fbank_lfr", options={"cmvn_file": str(p)}))
    assert fe.dim == 560
    feats, lens = fe.extract(speech)
    for i, x in enumerate(speech):
        fb = knf_fbank(x * 32768.0, window_type="hamming")
        want = (ref_lfr(fb, 7, 6) + shift) * rescale
        got = feats[i, : int(lens[i])].numpy()
        assert got.shape == want.shape
        d = np.abs(got - want)
        # CMVN rescale (< 0.5 here) shrinks the fbank tolerance
        assert d.max() <= MAX_TOL and d.mean() <= 1e-5, (d.max(), d.mean())
        assert not feats[i, int(lens[i]) :].any()
    assert fe.num_frames(len(speech[0])) == int(lens[0])


def test_cmvn_dim_mismatch(tmp_path):
    p = tmp_path / "am.mvn"
    write_am_mvn(p, np.zeros(400), np.ones(400))
    with pytest.raises(CheckpointError, match="400 dims"):
        FunASRFbankLFR(FeatureSpec(kind="funasr_fbank_lfr", options={"cmvn_file": str(p)}))


def test_short_audio_gives_no_frames():
    fe = FunASRFbankLFR()
    assert fe(torch.zeros(100)).shape == (0, 560)

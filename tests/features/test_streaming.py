"""Streaming framing: arbitrary chunking (including 1-sample chunks) yields exactly the frames of
the whole-signal computation (same count; values equal to 1e-5)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.errors import UnsupportedOptionError
from oasr.features.funasr import FunASRFbankLFR
from oasr.features.kaldi import KaldiFbank
from oasr.features.nemo import NemoMel
from oasr.features.whisper import WhisperLogMel
from oasr.types import FeatureSpec

FRONTENDS = {
    "kaldi": lambda: KaldiFbank(FeatureSpec(kind="kaldi_fbank", options={"scale": 32768.0})),
    "funasr": lambda: FunASRFbankLFR(FeatureSpec(kind="funasr_fbank_lfr")),
    "funasr_m5n3": lambda: FunASRFbankLFR(
        FeatureSpec(kind="funasr_fbank_lfr", options={"lfr_m": 5, "lfr_n": 3})
    ),
    "nemo": lambda: NemoMel(FeatureSpec(kind="nemo_mel", n_fft=512,
                                        options={"normalize": None})),
}
_CACHE: dict = {}


def frontend(name):
    if name not in _CACHE:
        _CACHE[name] = FRONTENDS[name]()
    return _CACHE[name]


def run_stream(fe, x, sizes):
    s = fe.stream()
    out, i, k = [], 0, 0
    while i < len(x):
        n = sizes[k % len(sizes)]
        k += 1
        out.append(s.accept(x[i : i + n]))
        i += n
    out.append(s.finish())
    return torch.cat(out)


def offline(fe, x):
    return fe(torch.from_numpy(x))


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(FRONTENDS)),
       start=st.integers(0, 16000), length=st.integers(0, 6000),
       sizes=st.lists(st.one_of(st.just(1), st.integers(1, 50), st.integers(50, 2000)),
                      min_size=1, max_size=12))
def test_random_chunking_matches_offline(speech, name, start, length, sizes):
    fe = frontend(name)
    x = speech[0][start : start + length]
    want = offline(fe, x)
    got = run_stream(fe, x, sizes)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(FRONTENDS))
def test_one_sample_chunks(speech, name):
    fe = frontend(name)
    x = speech[3][:2500]
    torch.testing.assert_close(run_stream(fe, x, [1]), offline(fe, x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(FRONTENDS))
def test_long_stream(speech, name):
    fe = frontend(name)
    x = speech[0]
    torch.testing.assert_close(run_stream(fe, x, [1600, 7, 3200, 160]), offline(fe, x),
                               atol=1e-5, rtol=1e-5)


def test_frames_are_emitted_early(speech):
    s = frontend("kaldi").stream()
    assert s.accept(speech[0][:399]).shape[0] == 0
    assert s.accept(speech[0][399:400]).shape[0] == 1
    assert s.accept(speech[0][400:560]).shape[0] == 1


def test_unstreamable_configs_refused():
    with pytest.raises(UnsupportedOptionError):
        NemoMel(FeatureSpec(kind="nemo_mel", n_fft=512)).stream()  # per_feature normalisation
    with pytest.raises(UnsupportedOptionError):
        KaldiFbank(FeatureSpec(kind="kaldi_fbank", options={"snip_edges": False})).stream()
    with pytest.raises(UnsupportedOptionError):
        WhisperLogMel(FeatureSpec(kind="whisper_logmel")).stream()

"""Decoded samples of real speech in every container match an independent reference.

Reference: the libsndfile-read source clip, channel-averaged, resampled with scipy's polyphase
``resample_poly`` (through the encoder's rate where it differs). Bounds (measured values in
brackets when this was written):

* lossless PCM/FLAC/AIFF, any rate: SNR >= 40 dB  [43-59 dB when resampled, 225 dB at 16 kHz]
* G.711 mu-law / A-law: SNR >= 30 dB  [37-39 dB: 8-bit companding noise]
* MP3, Opus, Vorbis: SNR >= 15 dB and correlation >= 0.99 after lag alignment  [23-39 dB]
* AAC: correlation >= 0.97 after lag alignment  [SNR 15 dB; our test encoder writes no edit
  list, so the 1024-sample priming shows up as a lag; real files with an edit list are trimmed]
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from _audio_helpers import CASES, SPEECH, align_snr, reference

from oasr.audio import load_audio


def _bounds(case):
    if case.codec in ("pcm_mulaw", "pcm_alaw"):
        return 30.0, 0.999, 0
    if case.codec == "aac":
        return None, 0.97, 4000
    if case.lossy:
        return 15.0, 0.99, 64
    return 40.0, 0.9999, 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_container_matches_reference(case, encoded, sources):
    y = load_audio(encoded[case.name])
    assert y.dtype == np.float32 and y.ndim == 1
    ref = reference(sources, case)
    snr_min, corr_min, max_lag = _bounds(case)
    snr, corr, lag = align_snr(ref, y)
    assert abs(lag) <= max_lag, (lag, snr, corr)
    assert corr >= corr_min, (snr, corr, lag)
    if snr_min is not None:
        assert snr >= snr_min, (snr, corr, lag)
    # length: the clip's duration at 16 kHz, plus codec padding for lossy codecs
    slack = 2000 if case.lossy else 2
    assert len(ref) - 2 <= len(y) <= len(ref) + slack


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_any_output_rate(encoded, rate):
    y = load_audio(encoded["flac.flac"], sample_rate=rate)
    assert abs(len(y) - 3 * rate) <= 2


def test_source_kinds_agree(encoded):
    p = encoded["flac.flac"]
    data = p.read_bytes()
    ref = load_audio(p)
    with open(p, "rb") as f:
        from_file = load_audio(f)
    for y in (load_audio(str(p)), load_audio(data), load_audio(bytearray(data)),
              load_audio(memoryview(data)), load_audio(io.BytesIO(data)), from_file):
        np.testing.assert_array_equal(y, ref)


def _manifest():
    return [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines()]


def test_every_corpus_file_decodes_with_its_duration():
    for item in _manifest():
        y = load_audio(SPEECH / item["audio"])
        assert y.dtype == np.float32
        assert abs(len(y) / 16000 - item["duration_s"]) < 0.03, item["audio"]
        assert 0.001 < float(np.abs(y).max()) <= 1.5


def test_jfk_mp3_and_m4a_match_flac():
    flac = load_audio(SPEECH / "en_jfk_inaugural.flac")
    for name in ("en_jfk_inaugural.mp3", "en_jfk_inaugural.m4a"):
        y = load_audio(SPEECH / name)
        snr, corr, lag = align_snr(flac, y)
        assert corr > 0.95 and abs(lag) < 400, (name, snr, corr, lag)

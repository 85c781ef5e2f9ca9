"""Property tests: random and mutated bytes give a waveform or an OASRError, never anything
else, and within a time bound."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.audio import RawPCMFormat, load_audio
from oasr.errors import OASRError

TIME_BOUND_S = 5.0
SEEDS = ["pcm16.wav", "mulaw8k.wav", "pcm48k.aiff", "flac.flac", "mp3_16k.mp3", "aac.m4a",
         "vorbis.ogg", "opus.ogg", "opus.webm"]
FUZZ = settings(max_examples=60, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def seeds(encoded):
    # keep the seeds small: the first ~0.5 s of each file's bytes is plenty of structure
    return {k: encoded[k].read_bytes() for k in SEEDS}


def _check(data: bytes, **kw) -> None:
    t0 = time.monotonic()
    try:
        y = load_audio(data, max_seconds=60, timeout_s=TIME_BOUND_S, **kw)
    except OASRError as e:
        assert str(e)
    else:
        assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.ndim == 1
        assert y.size > 0 and np.isfinite(y).all()
    assert time.monotonic() - t0 < TIME_BOUND_S + 1.0


@FUZZ
@given(st.binary(min_size=0, max_size=4096))
def test_random_bytes(data):
    _check(data)


@FUZZ
@given(st.binary(min_size=0, max_size=2048),
       st.sampled_from(["pcm_s16le", "pcm_s24le", "pcm_f32le", "mulaw", "alaw"]),
       st.integers(1, 3), st.sampled_from([8000, 16000, 44100]))
def test_random_raw_pcm(data, enc, ch, rate):
    _check(data, raw_format=RawPCMFormat(rate, enc, ch))  # type: ignore[arg-type]


@FUZZ
@given(st.data())
def test_mutated_real_files(seeds, data):
    name = data.draw(st.sampled_from(SEEDS))
    b = bytearray(seeds[name])
    op = data.draw(st.sampled_from(["truncate", "flip", "splice", "zero_run", "header"]))
    if op == "truncate":
        b = b[: data.draw(st.integers(0, len(b)))]
    elif op == "flip":
        for _ in range(data.draw(st.integers(1, 64))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif op == "splice":
        other = seeds[data.draw(st.sampled_from(SEEDS))]
        i, j = data.draw(st.integers(0, len(b))), data.draw(st.integers(0, len(other)))
        b = b[:i] + other[j:]
    elif op == "zero_run":
        i = data.draw(st.integers(0, len(b) - 1))
        n = data.draw(st.integers(1, 4096))
        b[i : i + n] = bytes(len(b[i : i + n]))
    else:  # random bytes over the first 64 bytes (headers)
        k = min(64, len(b))
        for _ in range(data.draw(st.integers(1, 16))):
            b[data.draw(st.integers(0, k - 1))] = data.draw(st.integers(0, 255))
    _check(bytes(b))


def _wav(tag, channels, rate, bits, data_len, payload):
    block = (channels * bits // 8) & 0xFFFF
    fmt = struct.pack("<HHIIHH", tag, channels, rate, (rate * block) & 0xFFFFFFFF, block, bits)
    return (b"RIFF" + struct.pack("<I", (36 + len(payload)) & 0xFFFFFFFF) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", data_len) + payload)


@FUZZ
@given(tag=st.sampled_from([1, 2, 3, 6, 7, 0x11, 0x55, 0xFFFE, 0x1234]),
       channels=st.integers(0, 300), rate=st.integers(0, 2**32 - 1),
       bits=st.sampled_from([0, 1, 4, 7, 8, 12, 16, 24, 32, 64, 255]),
       data_len=st.one_of(st.integers(0, 8192), st.just(0xFFFFFFFF)),
       n=st.integers(0, 8192))
def test_structured_wav_headers(speech_pcm, tag, channels, rate, bits, data_len, n):
    _check(_wav(tag, channels, rate, bits, data_len, speech_pcm[:n]))


@pytest.fixture(scope="module")
def speech_pcm(sources):
    x, _ = sources["mono16k"]
    return (np.clip(x[0], -1, 1) * 32767).astype("<i2").tobytes()

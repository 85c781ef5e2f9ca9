"""Bad input raises a typed OASRError with an actionable message, quickly."""

from __future__ import annotations

import io
import struct
import time

import av
import numpy as np
import pytest
import soundfile as sf

from oasr.audio import load_audio
from oasr.errors import AudioTooLongError, BadAudioError, InvalidRequestError, OASRError


def _wav_header(rate=16000, channels=1, bits=16, fmt_tag=1, data_len=0, riff_len=None):
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * block, block, bits)
    riff_len = 4 + 8 + len(fmt) + 8 + data_len if riff_len is None else riff_len
    return (b"RIFF" + struct.pack("<I", riff_len) + b"WAVE" + b"fmt " + struct.pack("<I", len(fmt))
            + fmt + b"data" + struct.pack("<I", data_len))


@pytest.fixture(scope="module")
def jpeg_bytes(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "x.jpg"
    with av.open(str(path), "w", format="image2") as out:
        st = out.add_stream("mjpeg", rate=1)
        st.width, st.height, st.pix_fmt = 64, 48, "yuvj420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((48, 64, 3), np.uint8), format="rgb24")
        for p in st.encode(frame.reformat(format="yuvj420p")):
            out.mux(p)
        for p in st.encode(None):
            out.mux(p)
    return path.read_bytes()


def test_empty_inputs(tmp_path):
    with pytest.raises(BadAudioError, match="empty"):
        load_audio(b"")
    (tmp_path / "e.wav").write_bytes(b"")
    with pytest.raises(BadAudioError, match="empty"):
        load_audio(tmp_path / "e.wav")
    with pytest.raises(BadAudioError, match="does not exist"):
        load_audio(tmp_path / "missing.wav")
    with pytest.raises(BadAudioError, match="directory"):
        load_audio(tmp_path)


def test_not_audio(jpeg_bytes):
    with pytest.raises(BadAudioError, match="no audio stream.*image|jpeg|mjpeg"):
        load_audio(jpeg_bytes)
    text = ("This is a plain text file posing as audio.\n" * 40).encode()
    with pytest.raises(BadAudioError):
        load_audio(text)
    with pytest.raises(BadAudioError):
        load_audio(b"<html><body>not audio</body></html>" * 10)


def test_truncated(encoded):
    data = encoded["mp3.mp3"].read_bytes()
    with pytest.raises(BadAudioError):
        load_audio(data[:20])
    flac = encoded["flac.flac"].read_bytes()
    with pytest.raises(BadAudioError):
        load_audio(flac[:30])  # header cut inside STREAMINFO
    # cut in the middle of the audio data: what decoded is returned (as ffmpeg does)
    y = load_audio(flac[: len(flac) // 2])
    assert 0 < len(y) < 48000


def test_zero_length_audio():
    with pytest.raises(BadAudioError, match="no audio samples|zero-length|could not"):
        load_audio(_wav_header(data_len=0))


def test_unsupported_codec():
    hdr = _wav_header(fmt_tag=0x7777, data_len=3200) + bytes(3200)
    with pytest.raises(BadAudioError, match="codec|decode|open"):
        load_audio(hdr)


@pytest.mark.parametrize(
    "kw", [dict(rate=0), dict(rate=2**31 - 1), dict(channels=0), dict(channels=4000)]
)
def test_absurd_headers(kw):
    data = _wav_header(data_len=3200, **kw) + bytes(3200)
    t0 = time.monotonic()
    with pytest.raises(BadAudioError):
        load_audio(data)
    assert time.monotonic() - t0 < 2.0


def test_lying_length_header_decodes_what_is_there():
    x = (np.sin(np.arange(8000) * 0.05) * 10000).astype("<i2").tobytes()
    data = _wav_header(data_len=0xFFFFFFF0, riff_len=0xFFFFFFF0) + x
    assert len(load_audio(data)) == 8000


def test_too_long_is_checked_while_decoding(tmp_path):
    # 10 minutes of 8 kHz noise; max_seconds=2 must fail long before a full decode would end.
    rng = np.random.default_rng(0)
    path = tmp_path / "long.wav"
    sf.write(path, (rng.standard_normal(8000 * 600) * 0.1).astype(np.float32), 8000,
             subtype="PCM_16")
    t0 = time.monotonic()
    with pytest.raises(AudioTooLongError, match="longer than the limit of 2 s"):
        load_audio(path, max_seconds=2)
    limited = time.monotonic() - t0
    t0 = time.monotonic()
    assert len(load_audio(path)) == 16000 * 600
    full = time.monotonic() - t0
    assert limited < 0.2 * full, (limited, full)


def test_max_seconds_boundary(encoded):
    assert len(load_audio(encoded["flac.flac"], max_seconds=3.0)) == 48000
    with pytest.raises(AudioTooLongError):
        load_audio(encoded["flac.flac"], max_seconds=2.9)
    err = AudioTooLongError("x")
    assert err.http_status == 413


def test_timeout_budget(encoded):
    with pytest.raises(BadAudioError, match="longer than 0 s"):
        load_audio(encoded["flac.flac"], timeout_s=0)


def test_bad_arguments(encoded):
    with pytest.raises(InvalidRequestError):
        load_audio(encoded["flac.flac"], sample_rate=0)
    with pytest.raises(InvalidRequestError):
        load_audio(encoded["flac.flac"], max_seconds=-1)
    with pytest.raises(InvalidRequestError):
        load_audio(12345)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="binary"):
        load_audio(io.StringIO("abc"))  # type: ignore[arg-type]


def test_errors_are_oasr_errors_with_codes():
    try:
        load_audio(b"garbage" * 100)
    except OASRError as e:
        assert e.code == "bad_audio" and e.http_status == 400 and str(e)

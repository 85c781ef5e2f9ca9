"""Raw PCM input, G.711 tables against FFmpeg's decoders, channel averaging."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from _encode import encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oasr.audio import RawPCMFormat, decode_raw_pcm, load_audio, resample
from oasr.errors import BadAudioError, InvalidRequestError


@pytest.fixture(scope="module")
def speech(sources):
    x, sr = sources["mono16k"]
    return x[0], sr


@pytest.mark.parametrize("codec,enc", [("pcm_mulaw", "mulaw"), ("pcm_alaw", "alaw")])
def test_g711_matches_ffmpeg(tmp_path, codec, enc):
    # Every one of the 256 code words, through FFmpeg's decoder and through ours.
    codes = np.arange(256, dtype=np.uint8).repeat(8)
    raw = codes.tobytes()
    ours = load_audio(raw, 8000, raw_format=RawPCMFormat(8000, enc))
    # The same bytes through FFmpeg's raw G.711 demuxer and decoder.
    import io

    import av

    fmt = RawPCMFormat(8000, enc)
    c = av.open(io.BytesIO(raw), format=enc, options={"sample_rate": "8000"})
    ff = np.concatenate([f.to_ndarray().reshape(-1) for f in c.decode(audio=0)])
    ff = ff.astype(np.float32) / 32768.0
    np.testing.assert_array_equal(decode_raw_pcm(raw, fmt)[0], ff)
    np.testing.assert_array_equal(ours, ff)


@pytest.mark.parametrize("encoding", ["pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le"])
@pytest.mark.parametrize("channels", [1, 2])
def test_raw_pcm_roundtrip(tmp_path, speech, encoding, channels):
    x, sr = speech
    x = x[:16000]
    chans = np.stack([x, 0.5 * x])[:channels]
    subtype = {"pcm_s16le": "PCM_16", "pcm_s24le": "PCM_24", "pcm_s32le": "PCM_32",
               "pcm_f32le": "FLOAT"}[encoding]
    sf.write(tmp_path / "a.raw", chans.T, sr, subtype=subtype, format="RAW", endian="LITTLE")
    raw = (tmp_path / "a.raw").read_bytes()
    y = load_audio(raw, sr, raw_format=RawPCMFormat(sr, encoding, channels))
    want = chans.mean(axis=0)
    tol = {"pcm_s16le": 1 / 32768, "pcm_s24le": 1e-6, "pcm_s32le": 1e-7, "pcm_f32le": 1e-7}
    np.testing.assert_allclose(y, want, atol=tol[encoding] * 1.01)
    # and through the file-object / path sources
    np.testing.assert_array_equal(
        load_audio(tmp_path / "a.raw", sr, raw_format=RawPCMFormat(sr, encoding, channels)), y
    )


def test_raw_pcm_resampled(speech):
    x, sr = speech
    pcm = (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()
    y = load_audio(pcm, 8000, raw_format=RawPCMFormat(16000))
    assert abs(len(y) - len(x) // 2) <= 1


def test_raw_pcm_errors():
    with pytest.raises(BadAudioError, match="multiple of 4"):
        load_audio(b"\x00" * 7, raw_format=RawPCMFormat(16000, "pcm_s16le", 2))
    with pytest.raises(BadAudioError, match="empty"):
        load_audio(b"", raw_format=RawPCMFormat(16000))
    with pytest.raises(BadAudioError, match="NaN"):
        load_audio(np.array([0.0, np.nan], "<f4").tobytes(), raw_format=RawPCMFormat(16000, "pcm_f32le"))
    with pytest.raises(InvalidRequestError):
        RawPCMFormat(16000, "pcm_u8")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError):
        RawPCMFormat(0)
    with pytest.raises(InvalidRequestError):
        RawPCMFormat(16000, channels=0)


def test_stereo_is_averaged(tmp_path, speech):
    x, sr = speech
    x = x[:16000]
    p = encode(np.stack([x, np.zeros_like(x)]), sr, tmp_path / "lr.wav", container="wav",
               codec="pcm_f32le")
    np.testing.assert_allclose(load_audio(p), 0.5 * x, atol=1e-7)
    p = encode(np.stack([x, -x]), sr, tmp_path / "anti.flac", container="flac", codec="flac")
    assert np.abs(load_audio(p)).max() < 1e-4


def test_resample_streaming_equals_whole(speech):
    from oasr.audio import Resampler

    x, sr = speech
    whole = resample(x, sr, 8000)
    rs = Resampler(sr, 8000)
    rng = np.random.default_rng(0)
    parts, i = [], 0
    while i < len(x):
        n = int(rng.integers(1, 3000))
        parts.append(rs.process(x[i : i + n]))
        i += n
    parts.append(rs.flush())
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)


@pytest.mark.parametrize("channels", [3, 6, 8, 9, 16, 64])
def test_many_channels_are_averaged(tmp_path, channels):
    # 8+ channel frames once crashed PyAV's planar to_ndarray; decoding uses packed samples now.
    rng = np.random.default_rng(channels)
    x = (rng.standard_normal((8000, channels)) * 0.1).astype(np.float32)
    sf.write(tmp_path / "multi.wav", x, 16000, subtype="FLOAT")
    y = load_audio(tmp_path / "multi.wav")
    np.testing.assert_allclose(y, x.mean(axis=1), atol=1e-6)
    assert len(load_audio(tmp_path / "multi.wav", 8000)) == 4000


def test_too_many_channels_rejected(tmp_path):
    x = np.zeros((1600, 65), np.float32)
    sf.write(tmp_path / "c65.wav", x, 16000, subtype="PCM_16")
    with pytest.raises(BadAudioError, match="65 channels"):
        load_audio(tmp_path / "c65.wav")


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cuts=st.lists(st.integers(0, 12000), max_size=20),
       enc=st.sampled_from(["pcm_s16le", "pcm_s24le", "mulaw"]), channels=st.integers(1, 2),
       rate=st.sampled_from([8000, 16000, 44100]))
def test_raw_pcm_stream_equals_whole(speech, cuts, enc, channels, rate):
    from oasr.audio import RawPCMStream

    x, _ = speech
    fmt = RawPCMFormat(rate, enc, channels)
    n = 6000
    pcm16 = (np.clip(x[: n * channels], -1, 1) * 32767).astype("<i2")
    if enc == "pcm_s16le":
        raw = pcm16.tobytes()
    elif enc == "pcm_s24le":
        raw = b"".join((int(v) * 256).to_bytes(3, "little", signed=True) for v in pcm16[:4000])
        raw = raw[: len(raw) - len(raw) % fmt.bytes_per_frame]
    else:
        raw = (pcm16.view(np.uint16) >> 8).astype(np.uint8).tobytes()
        raw = raw[: len(raw) - len(raw) % fmt.bytes_per_frame]
    whole = load_audio(raw, 16000, raw_format=fmt)
    s = RawPCMStream(fmt, 16000)
    bounds = sorted({min(c, len(raw)) for c in cuts} | {0, len(raw)})
    parts = [s.feed(raw[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)] + [s.finish()]
    np.testing.assert_allclose(np.concatenate(parts), whole, atol=1e-6)


def test_raw_pcm_stream_errors():
    from oasr.audio import RawPCMStream
    from oasr.errors import AudioTooLongError

    s = RawPCMStream(RawPCMFormat(16000), 16000, max_seconds=1)
    s.feed(b"\x00" * 32000)
    with pytest.raises(AudioTooLongError):
        s.feed(b"\x00" * 3200)
    s = RawPCMStream(RawPCMFormat(16000), 16000)
    s.feed(b"\x00\x00\x00")
    with pytest.raises(BadAudioError, match="stray"):
        s.finish()

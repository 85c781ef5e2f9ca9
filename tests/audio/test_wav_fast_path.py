"""The numpy WAV fast path of ``load_audio``: bit-identical to the PyAV path, or not taken.

Every case decodes the same bytes twice, once as ``load_audio`` does and once with the fast path
switched off (``oasr.audio._WAV_FAST_PATH``), and compares the outcomes: the float32 bits of the
result, or the error's type and message. A wrapper around ``_decode_container`` tells which path
``load_audio`` took.
"""

from __future__ import annotations

import io
import json
import struct
import wave

import numpy as np
import pytest
from _audio_helpers import SPEECH
from _encode import encode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oasr.audio as audio
from oasr.audio import load_audio
from oasr.errors import OASRError

PCM, FLOAT, EXT = 1, 3, 0xFFFE
GUID_TAIL = b"\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"


# -- building WAVs by hand -------------------------------------------------------------------


def chunk(tag: bytes, body: bytes, size: int | None = None) -> bytes:
    """A RIFF chunk; ``size`` overrides the declared size. Padded to an even length."""
    declared = len(body) if size is None else size
    return tag + struct.pack("<I", declared) + body + b"\0" * (len(body) & 1)


def fmt_body(tag=PCM, ch=1, rate=16000, bits=16, *, align=None, sub=PCM, valid=None, mask=0,
             cb=22) -> bytes:
    align = ch * bits // 8 if align is None else align
    head = struct.pack("<HHIIHH", tag, ch, rate, rate * align, align, bits)
    if tag != EXT:
        return head
    ext = struct.pack("<HHII", cb, bits if valid is None else valid, mask, sub)
    return head + ext + GUID_TAIL


def riff(*chunks: bytes) -> bytes:
    body = b"WAVE" + b"".join(chunks)
    return b"RIFF" + struct.pack("<I", len(body)) + body


def wav(payload: bytes, *, pre=(), mid=(), post=(), data_size=None, **fmt) -> bytes:
    """RIFF/WAVE: chunks ``pre``, 'fmt ', ``mid``, 'data' (``payload``), ``post``."""
    return riff(*pre, chunk(b"fmt ", fmt_body(**fmt)), *mid, chunk(b"data", payload, data_size),
                *post)


def samples(kind: str, n: int, ch: int, seed: int) -> np.ndarray:
    """Random interleaved samples with the extreme values placed among them."""
    rng = np.random.default_rng(seed)
    if kind == "s16":
        x = rng.integers(-32768, 32768, n * ch, dtype=np.int16)
        special = np.array([-32768, 32767, 0, -1, 1, -32767], np.int16)
    else:
        x = (rng.standard_normal(n * ch) * 0.3).astype(np.float32)
        special = np.array([1.0, -1.0, 0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.17549435e-38,
                            1.5, -2.0, 0.99999994], np.float32)
    k = min(len(special), len(x))
    x[rng.choice(len(x), k, replace=False)] = special[:k]
    return x


def make(kind: str, ch: int, rate: int, n: int, seed: int = 0, ext: bool = False) -> bytes:
    x = samples(kind, n, ch, seed)
    tag, bits = (PCM, 16) if kind == "s16" else (FLOAT, 32)
    if ext:
        return wav(x.tobytes(), tag=EXT, sub=tag, ch=ch, rate=rate, bits=bits,
                   mask=(0x4, 0x3)[ch - 1])
    return wav(x.tobytes(), tag=tag, ch=ch, rate=rate, bits=bits)


# -- running both paths ----------------------------------------------------------------------


def _outcome(source, rate, kw):
    try:
        return load_audio(source, rate, **kw)
    except OASRError as e:
        return (type(e).__name__, str(e))


def run(source, rate=16000, **kw):
    """(outcome with the fast path enabled, whether it was taken, outcome of the PyAV path)."""
    calls = []
    original = audio._decode_container
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(audio, "_decode_container", lambda *a: calls.append(1) or original(*a))
        fast = _outcome(source, rate, kw)
        taken = not calls
        mp.setattr(audio, "_WAV_FAST_PATH", False)
        slow = _outcome(source, rate, kw)
    return fast, taken, slow


def assert_same(a, b) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), (a, b)
        assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))  # bits, so -0.0 != 0.0
        assert a.flags.c_contiguous and a.flags.writeable and a.flags.owndata
    else:
        assert a == b


def check(source, rate=16000, *, taken: bool | None = True, **kw):
    fast, was_taken, slow = run(source, rate, **kw)
    assert_same(fast, slow)
    if taken is not None:
        assert was_taken == taken
    return fast


# -- bit-exactness ---------------------------------------------------------------------------

RATES = [8000, 16000, 22050, 44100, 48000]


@pytest.mark.parametrize("ext", [False, True], ids=["plain", "extensible"])
@pytest.mark.parametrize("ch", [1, 2])
@pytest.mark.parametrize("kind", ["s16", "f32"])
def test_random_samples_bit_exact(kind, ch, ext):
    for i, rate in enumerate(RATES):
        lengths = [1, 2, 7, 1001, rate // 2] + ([3 * rate] if rate in (16000, 48000) else [])
        for n in lengths:
            y = check(make(kind, ch, rate, n, seed=i * 100 + n, ext=ext), rate)
            assert len(y) == n


@pytest.mark.parametrize("ch", [1, 2])
def test_stdlib_wave_module(ch):
    x = samples("s16", 16000, ch, seed=7)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(ch)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(x.tobytes())
    check(buf.getvalue())


def test_fast_path_taken_for_16k_mono_s16(monkeypatch):
    def pyav_path(*a):
        raise AssertionError("the PyAV path was used")

    x = samples("s16", 16000, 1, seed=1)
    monkeypatch.setattr(audio, "_decode_container", pyav_path)
    y = load_audio(wav(x.tobytes()))
    assert np.array_equal(y, x.astype(np.float32) / 32768)


@pytest.mark.parametrize("mask", [0, 0x3, 0x9, 0x7, 0x80000000])
def test_extensible_channel_masks(mask):
    x = samples("s16", 4000, 2, seed=mask % 97)
    check(wav(x.tobytes(), tag=EXT, ch=2, mask=mask))
    x = samples("f32", 4000, 1, seed=3)
    check(wav(x.tobytes(), tag=EXT, sub=FLOAT, bits=32, mask=mask & 0x4))


# -- what the fast path accepts and what it leaves to PyAV ------------------------------------

_S16 = samples("s16", 8000, 1, seed=11).tobytes()
_S16_ST = samples("s16", 8000, 2, seed=12).tobytes()
_LIST = chunk(b"LIST", b"INFOISFT" + struct.pack("<I", 5) + b"oasr\0\0")

_SPDIF, _TRUEHD = b"\x72\xf8\x1f\x4e", b"\xf8\x72\x6f\xba"
_DTS = b"\x7f\xfe\x80\x01\xfc\x00"  # core sync + the bits FFmpeg's DTS probe checks next
_MXF = bytes.fromhex("060e2b34020501010d01020101020400")
_MP3 = b"\xff\xfb\x90\x64"  # MPEG-1 layer III, 128 kbit/s, 44.1 kHz: 417-byte frames


def _put(b: bytes, at: dict[int, bytes]) -> bytes:
    out = bytearray(b)
    for k, v in at.items():
        out[k : k + len(v)] = v
    return bytes(out)


ACCEPTED = {
    "LIST before data": wav(_S16, mid=[_LIST]),
    "LIST before fmt": wav(_S16, pre=[_LIST]),
    "odd-size chunk with pad byte": wav(_S16, mid=[chunk(b"JUNK", b"abcde")]),
    "odd-size chunk before fmt": wav(_S16, pre=[chunk(b"PAD ", b"x" * 7)]),
    "LIST and fact after data": wav(_S16, post=[_LIST, chunk(b"fact", struct.pack("<I", 8000))]),
    "fact before data": wav(_S16, mid=[chunk(b"fact", struct.pack("<I", 8000))]),
    "trailing chunk cut short": wav(_S16, post=[chunk(b"LIST", b"INFO", size=100)]),
    "3 stray bytes at the end": wav(_S16) + b"dat",
    "fmt with cbSize 0": wav(_S16).replace(
        chunk(b"fmt ", fmt_body()), chunk(b"fmt ", fmt_body() + b"\0\0")),
    "wrong RIFF size": b"RIFF\0\0\0\0" + wav(_S16)[8:],
    "stereo": wav(_S16_ST, ch=2),
    # below what FFmpeg's probes need (checked against the PyAV path like every case here)
    "1 S/PDIF preamble": wav(_put(_S16, {400: _SPDIF})),
    "3 DTS syncs": wav(_put(_S16, {k: _DTS for k in (4100, 5000, 6000)})),
    "MXF key after 2 KiB": wav(_put(_S16, {3000: _MXF})),
    "starts with 1 MP3 frame header": wav(_put(_S16, {0: _MP3})),
    "starts with near-silence": wav(b"\xff\xff\xfe\xff\x01\x00" + _S16[6:]),
    "starts with zeros then -1": wav(bytes(100) + b"\xff\xff\x02\x00" + _S16[104:]),
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_fast_path_accepts(name):
    check(ACCEPTED[name], taken=True)


FALLBACK = {
    "8-bit": wav(bytes(range(256)) * 8, bits=8),
    "24-bit": wav(_S16[: len(_S16) // 6 * 6], bits=24),
    "32-bit int": wav(_S16, bits=32),
    "64-bit float": wav(_S16, tag=FLOAT, bits=64),
    "16-bit float tag": wav(_S16, tag=FLOAT, bits=16),
    "mu-law": wav(_S16, tag=7, bits=8),
    "3 channels": wav(_S16[:47994], ch=3),
    "6 channels": wav(_S16[:15996], ch=6),
    "extensible 4 channels": wav(_S16, tag=EXT, ch=4, mask=0x33),
    "rate mismatch": wav(_S16, rate=22050),
    "block_align mismatch": wav(_S16, align=4),
    "data not whole frames": wav(_S16_ST[:-2], ch=2),
    "truncated data chunk": wav(_S16[:-100], data_size=len(_S16)),
    "data size 0xFFFFFFFF": wav(_S16, data_size=0xFFFFFFFF),
    "data size 0": wav(_S16, data_size=0),
    "empty data": wav(b""),
    "garbage after RIFF": b"RIFF" + struct.pack("<I", 100) + bytes(range(256)) * 4,
    "RIFF but not WAVE": b"RIFF" + wav(_S16)[4:8] + b"AVI " + wav(_S16)[12:],
    "RF64": b"RF64" + wav(_S16)[4:],
    "fmt after data": riff(chunk(b"data", _S16), chunk(b"fmt ", fmt_body())),
    "no fmt": riff(chunk(b"data", _S16)),
    "two fmt": wav(_S16, mid=[chunk(b"fmt ", fmt_body(rate=8000))]),
    "two data chunks": wav(_S16, post=[chunk(b"data", _S16[:1000])]),
    "'data' tag at the very end": wav(_S16) + b"data",
    "garbage after the data chunk": wav(_S16) + bytes(range(40)),
    "fmt too short": wav(_S16).replace(chunk(b"fmt ", fmt_body()), chunk(b"fmt ", fmt_body()[:14])),
    "bext chunk": wav(_S16, mid=[chunk(b"bext", bytes(602))]),
    "id3 chunk": wav(_S16, post=[chunk(b"id3 ", b"ID3\x04\0\0\0\0\0\0")]),
    "cue chunk": wav(_S16, mid=[chunk(b"cue ", struct.pack("<I", 1) + bytes(24))]),
    "LIST shorter than 4": wav(_S16, mid=[chunk(b"LIST", b"IN")]),
    "chunk before data runs past EOF": wav(_S16, mid=[chunk(b"JUNK", b"", size=10**6)]),
    "extensible valid bits 12": wav(_S16, tag=EXT, valid=12),
    "extensible valid bits 0": wav(_S16, tag=EXT, valid=0),
    "extensible cbSize 0": wav(_S16, tag=EXT, cb=0),
    "extensible unknown GUID": wav(_S16, tag=EXT, sub=0x55),
    "extensible fmt too short": wav(_S16).replace(
        chunk(b"fmt ", fmt_body()), chunk(b"fmt ", fmt_body(tag=EXT)[:24])),
    "2 S/PDIF preambles": wav(_put(_S16, {400: _SPDIF, 6544: _SPDIF})),
    "TrueHD sync": wav(_put(_S16, {9001: _TRUEHD})),
    "4 DTS syncs": wav(_put(_S16, {k: _DTS for k in (4100, 5000, 6000, 9000)})),
    "MXF key in the first 2 KiB": wav(_put(_S16, {1000: _MXF})),
    "data starts with 2 chained MP3 frames": wav(_put(_S16, {0: _MP3, 417: _MP3})),  # 417 B each
    "data starts like AC-3": wav(b"\x0b\x77" + _S16[2:]),
    "MOV atom as RIFF size": b"RIFFmoovWAVE" + wav(_S16)[12:],
    "ACT signature": wav(bytes(212) + b"\x84" + bytes(255) + _S16[:7000]),
    "too many chunks": wav(_S16, mid=[chunk(b"JUNK", b"")] * 70),
}


@pytest.mark.parametrize("name", list(FALLBACK))
def test_falls_back(name):
    check(FALLBACK[name], taken=False)


def test_falls_back_with_wrong_rate_for_every_rate():
    for rate in RATES:
        b = make("s16", 1, rate, 1000, seed=rate)
        for target in RATES:
            if target != rate:
                check(b, target, taken=False)


def test_non_finite_floats_raise_the_same_error():
    x = samples("f32", 1000, 1, seed=5)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[500] = bad
        res = check(wav(y.tobytes(), tag=FLOAT, bits=32))
        assert res[0] == "BadAudioError" and "NaN or infinite" in res[1]
    big = np.full(200, 3e38, np.float32)  # finite, but the stereo mean overflows to inf
    res = check(wav(big.tobytes(), tag=FLOAT, bits=32, ch=2))
    assert res[0] == "BadAudioError"


# -- budget ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rate", [8000, 16000, 44100])
def test_max_seconds_boundary_matches_pyav(rate):
    for max_s in (0.25, 1.0, 2.0, 3.3):
        edge = round((max_s + audio.LENGTH_SLACK_S) * rate)  # n / rate ~ the limit
        for n in range(edge - 2, edge + 3):
            res = check(make("s16", 1, rate, n, seed=n), rate, max_seconds=max_s)
            if n != edge:
                assert isinstance(res, np.ndarray) == (n < edge)
    res = check(make("s16", 2, rate, 3 * rate), rate, max_seconds=1)
    assert res[0] == "AudioTooLongError" and "limit of 1 s" in res[1]


def test_hard_cap_matches_pyav(monkeypatch):
    monkeypatch.setattr(audio, "HARD_MAX_SECONDS", 0.5)
    res = check(make("f32", 1, 16000, 16000))
    assert res[0] == "AudioTooLongError" and "hard cap" in res[1]


# -- sources ---------------------------------------------------------------------------------


def test_sources_agree(tmp_path):
    b = make("s16", 2, 16000, 12345, seed=9)
    p = tmp_path / "a.wav"
    p.write_bytes(b)
    ref = check(b)
    views = (memoryview(b), memoryview(np.frombuffer(b, np.uint8)), memoryview(b).cast("h"))
    for src in (p, str(p), bytearray(b), *views):
        assert_same(check(src), ref)
    check(p, 8000, taken=False)  # another rate: resampled by PyAV
    odd = tmp_path / "rec:1.wav"  # FFmpeg reads "rec:" as a protocol name
    odd.write_bytes(b)
    check(odd, taken=False)


def test_result_is_not_a_view_of_the_input():
    x = samples("f32", 1000, 1, seed=2)
    b = bytearray(wav(x.tobytes(), tag=FLOAT, bits=32))
    y = check(b)
    b[-4000:] = bytes(4000)
    assert np.array_equal(y, x) and y.flags.writeable
    y[0] = 0.5  # writable


@pytest.fixture(scope="module")
def speech_wavs() -> list[tuple[str, int]]:
    rows = [json.loads(line) for line in (SPEECH / "manifest.jsonl").read_text().splitlines()]
    return [(r["audio"], r["sample_rate"]) for r in rows if r["audio"].endswith(".wav")]


def test_real_speech_wavs(speech_wavs):
    assert sum(rate == 16000 for _, rate in speech_wavs) >= 5
    for fname, rate in speech_wavs:
        path = SPEECH / fname
        if rate == 16000:
            check(path)
            check(path.read_bytes())
        else:  # at their own rate the fast path reads them; at 16 kHz PyAV resamples them
            check(path, rate)
            assert audio._decode_wav(path.read_bytes(), 16000, audio._Budget(16000, None, None)) \
                is None


# -- bitstreams that FFmpeg finds inside 'PCM' WAVs ------------------------------------------


@pytest.mark.parametrize("container,codec", [
    ("mp3", "libmp3lame"), ("mp2", "mp2"), ("ac3", "ac3"), ("eac3", "eac3"), ("adts", "aac"),
    ("latm", "aac"), ("spdif", "ac3"), ("spdif", "eac3")])
def test_bitstream_labelled_as_pcm(tmp_path, container, codec):
    # FFmpeg sniffs 16-bit PCM WAV data and decodes these as the codec (or fails): fall back.
    t = np.arange(24000) / 48000
    x = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)]).astype(np.float32)
    stream = encode(0.3 * x, 48000, tmp_path / "s", container=container, codec=codec).read_bytes()
    stream = stream[: len(stream) // 4 * 4]
    check(wav(stream, ch=2, rate=48000), 48000, taken=False)


# -- fuzz: header mutations never make the two paths disagree --------------------------------

_BASE = wav(samples("s16", 1600, 2, seed=4).tobytes(), ch=2, mid=[_LIST],
            post=[chunk(b"fact", struct.pack("<I", 1600))])
_TAGS = [b"fmt ", b"data", b"LIST", b"JUNK", b"fact", b"bext", b"id3 ", b"cue ", b"abcd"]


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzzed_headers_agree(data):
    b = bytearray(_BASE)
    for _ in range(data.draw(st.integers(0, 3))):
        op = data.draw(st.sampled_from(["byte", "truncate", "insert", "size"]))
        if op == "byte":
            if b:
                b[data.draw(st.integers(0, min(79, len(b) - 1)))] = data.draw(st.integers(0, 255))
        elif op == "truncate":
            del b[data.draw(st.integers(0, len(b))):]
        elif op == "insert":
            at = data.draw(st.sampled_from([12, 36, 36 + len(_LIST), len(b)]))
            body = data.draw(st.binary(max_size=9))
            b[at:at] = chunk(data.draw(st.sampled_from(_TAGS)), body)
        else:  # rewrite a chunk size field
            at = data.draw(st.sampled_from([16, 40, 44 + len(_LIST) - 4]))
            size = data.draw(st.sampled_from([0, 1, 3, 4, 6400, 6401, 0xFFFFFFFF]))
            b[at : at + 4] = struct.pack("<I", size)
    fast, _, slow = run(bytes(b))
    assert_same(fast, slow)

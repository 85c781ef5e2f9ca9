"""Audio input: decode any container/codec (or declared raw PCM) to float32 mono at a given rate.

Decoding uses PyAV (FFmpeg bundled in the wheel; no system ffmpeg is needed). Multi-channel audio
is down-mixed by averaging the channels. Resampling uses FFmpeg's libswresample through
``av.AudioResampler`` (windowed-sinc polyphase filter, 32 taps per phase at 1024 phases, cutoff
0.97 of Nyquist): it streams frame by frame, so no full-rate copy of a long input is kept, and it is
the resampler behind ``ffmpeg -ar 16000`` that openai-whisper and most reference pipelines use.

Every failure raises an :class:`~oasr.errors.OASRError` subclass with a message that says what to
change: :class:`~oasr.errors.BadAudioError` for undecodable, empty, corrupt or absurd input, and
:class:`~oasr.errors.AudioTooLongError` once more than ``max_seconds`` have been *decoded* (so a
10-hour file is rejected after ``max_seconds`` of work, not after decoding all of it). Decoding is
bounded in time (``timeout_s``) and memory (a hard cap on decoded seconds and channels).

Nothing here imports torch; PyAV is imported on first use.
"""

from __future__ import annotations

import io
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal

import numpy as np

from oasr.errors import AudioTooLongError, BadAudioError, InvalidRequestError

__all__ = [
    "RawPCMFormat",
    "RawPCMStream",
    "Resampler",
    "load_audio",
    "as_mono_waveform",
    "decode_raw_pcm",
    "resample",
    "HARD_MAX_SECONDS",
    "DEFAULT_TIMEOUT_S",
]

#: Absolute cap on decoded audio when the caller gives no ``max_seconds`` (memory bound: 6 h of
#: 16 kHz float32 mono is 1.4 GB).
HARD_MAX_SECONDS = 6 * 3600.0
#: Default wall-clock budget for one decode.
DEFAULT_TIMEOUT_S = 300.0
#: Slack on ``max_seconds`` for codec padding (MP3/AAC priming frames), in seconds.
LENGTH_SLACK_S = 0.05
MAX_CHANNELS = 64
MIN_RATE, MAX_RATE = 1000, 768_000

Source = str | os.PathLike | bytes | bytearray | memoryview | IO[bytes]

RawEncoding = Literal["pcm_s16le", "pcm_s24le", "pcm_s32le", "pcm_f32le", "mulaw", "alaw"]
_RAW_WIDTH = {"pcm_s16le": 2, "pcm_s24le": 3, "pcm_s32le": 4, "pcm_f32le": 4, "mulaw": 1, "alaw": 1}


@dataclass(frozen=True)
class RawPCMFormat:
    """Declares headerless PCM: its rate, sample encoding and interleaved channel count."""

    sample_rate: int
    encoding: RawEncoding = "pcm_s16le"
    channels: int = 1

    def __post_init__(self) -> None:
        if self.encoding not in _RAW_WIDTH:
            raise InvalidRequestError(
                f"raw PCM encoding must be one of {sorted(_RAW_WIDTH)}, not {self.encoding!r}",
                param="raw_format",
            )
        if not (isinstance(self.sample_rate, int) and MIN_RATE <= self.sample_rate <= MAX_RATE):
            raise InvalidRequestError(
                f"raw PCM sample_rate must be an integer in [{MIN_RATE}, {MAX_RATE}] Hz, "
                f"not {self.sample_rate!r}",
                param="raw_format",
            )
        if not (isinstance(self.channels, int) and 1 <= self.channels <= MAX_CHANNELS):
            raise InvalidRequestError(
                f"raw PCM channels must be in [1, {MAX_CHANNELS}], not {self.channels!r}",
                param="raw_format",
            )

    @property
    def bytes_per_frame(self) -> int:
        return _RAW_WIDTH[self.encoding] * self.channels


# --------------------------------------------------------------------------------------------
# G.711 (ITU-T) expansion tables, built from the standard's segment/mantissa definitions.


def _mulaw_table() -> np.ndarray:
    u = ~np.arange(256, dtype=np.int32) & 0xFF
    sign = u & 0x80
    exponent = (u >> 4) & 0x07
    mantissa = u & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -magnitude, magnitude).astype(np.float32) / 32768.0


def _alaw_table() -> np.ndarray:
    a = np.arange(256, dtype=np.int32) ^ 0x55
    sign = a & 0x80
    exponent = (a >> 4) & 0x07
    mantissa = a & 0x0F
    magnitude = np.where(
        exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0)
    )
    return np.where(sign != 0, magnitude, -magnitude).astype(np.float32) / 32768.0


_G711: dict[str, np.ndarray] = {}


def decode_raw_pcm(data: bytes | bytearray | memoryview, fmt: RawPCMFormat) -> np.ndarray:
    """Raw interleaved PCM bytes -> float32 array of shape (channels, samples) in [-1, 1]."""
    buf = memoryview(data).cast("B")
    n = len(buf)
    if n % fmt.bytes_per_frame:
        raise BadAudioError(
            f"raw {fmt.encoding} audio with {fmt.channels} channel(s) needs a multiple of "
            f"{fmt.bytes_per_frame} bytes, got {n}; check the declared raw format or the upload"
        )
    enc = fmt.encoding
    if enc == "pcm_s16le":
        x = np.frombuffer(buf, dtype="<i2").astype(np.float32) / 32768.0
    elif enc == "pcm_s32le":
        x = (np.frombuffer(buf, dtype="<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    elif enc == "pcm_s24le":
        b = np.frombuffer(buf, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
        v = np.where(v >= 1 << 23, v - (1 << 24), v)
        x = v.astype(np.float32) / 8388608.0
    elif enc == "pcm_f32le":
        x = np.frombuffer(buf, dtype="<f4").astype(np.float32)
        if not np.isfinite(x).all():
            raise BadAudioError(
                "raw pcm_f32le audio contains NaN or infinite samples; is the declared "
                "encoding right (maybe pcm_s16le)?"
            )
    else:  # mulaw / alaw
        table = _G711.get(enc)
        if table is None:
            table = _G711[enc] = _mulaw_table() if enc == "mulaw" else _alaw_table()
        x = table[np.frombuffer(buf, dtype=np.uint8)]
    return np.ascontiguousarray(x.reshape(-1, fmt.channels).T)


# --------------------------------------------------------------------------------------------
# Resampling


class Resampler:
    """Streaming mono float32 resampler (libswresample via PyAV). Feed chunks, then ``flush``.

    The concatenated outputs equal resampling the whole signal at once.
    """

    def __init__(self, src_rate: int, dst_rate: int) -> None:
        if not (MIN_RATE <= src_rate <= MAX_RATE and MIN_RATE <= dst_rate <= MAX_RATE):
            raise BadAudioError(
                f"cannot resample {src_rate} Hz -> {dst_rate} Hz; rates must be in "
                f"[{MIN_RATE}, {MAX_RATE}] Hz"
            )
        self.src_rate = int(src_rate)
        self.dst_rate = int(dst_rate)
        self._identity = self.src_rate == self.dst_rate
        self._rs = None
        if not self._identity:  # equal rates pass through: no PyAV needed
            import av

            self._rs = av.AudioResampler(format="flt", layout="mono", rate=self.dst_rate)

    def _pull(self, frames: list[Any]) -> np.ndarray:
        if not frames:
            return np.zeros(0, np.float32)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(
            np.float32, copy=False
        )

    def process(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        if self._identity or x.size == 0:
            return x.copy() if self._identity else np.zeros(0, np.float32)
        import av

        frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
        frame.sample_rate = self.src_rate
        return self._pull(self._rs.resample(frame))

    def flush(self) -> np.ndarray:
        if self._identity:
            return np.zeros(0, np.float32)
        return self._pull(self._rs.resample(None))


def as_mono_waveform(audio: Any, what: str = "audio") -> np.ndarray:
    """``audio`` (a numpy array or a torch tensor) as a mono float32 waveform, checked: one
    dimension, finite samples. Every model and the engine take waveforms through this, so a bad
    array is the same typed :class:`BadAudioError` wherever it enters."""
    if hasattr(audio, "detach"):  # a torch tensor, without importing torch here
        audio = audio.detach().cpu().numpy()
    a = np.asarray(audio)
    if a.ndim != 1:
        raise BadAudioError(f"{what} must be a mono 1-D waveform, got shape {a.shape}")
    a = a.astype(np.float32, copy=False)
    # the sum of squares is finite when every sample is (one BLAS pass, no mask array); only
    # when it is not (NaN, inf, or finite samples so large their squares overflow) is each
    # sample checked
    if a.size:
        with np.errstate(over="ignore", invalid="ignore"):
            finite = bool(np.isfinite(np.dot(a, a))) or bool(np.isfinite(a).all())
        if not finite:
            raise BadAudioError(f"{what} contains NaN or infinite samples")
    return a


def resample(x: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Resample a mono float32 signal from ``src_rate`` to ``dst_rate`` (whole-signal)."""
    rs = Resampler(src_rate, dst_rate)
    out = [rs.process(x), rs.flush()]
    return np.concatenate(out)


class RawPCMStream:
    """Streaming decoder for headerless PCM arriving in chunks (WebSocket / gRPC streams).

    ``feed(data)`` accepts bytes split anywhere (even inside a sample) and returns float32 mono
    samples at ``sample_rate`` that are ready; ``finish()`` flushes the resampler. The
    concatenated output equals ``load_audio(all_bytes, sample_rate, raw_format=fmt)``. A stream
    longer than ``max_seconds`` raises :class:`AudioTooLongError`; a trailing partial sample at
    ``finish()`` raises :class:`BadAudioError`.
    """

    def __init__(
        self, fmt: RawPCMFormat, sample_rate: int = 16000, *, max_seconds: float | None = None
    ) -> None:
        self.fmt = fmt
        self.sample_rate = int(sample_rate)
        self._rs = Resampler(fmt.sample_rate, self.sample_rate)
        self._pending = b""
        self._budget = _Budget(self.sample_rate, max_seconds, None)

    def feed(self, data: bytes | bytearray | memoryview) -> np.ndarray:
        buf = self._pending + bytes(data)
        usable = len(buf) - len(buf) % self.fmt.bytes_per_frame
        self._pending = buf[usable:]
        if usable == 0:
            return np.zeros(0, np.float32)
        self._budget.add(usable // self.fmt.bytes_per_frame / self.fmt.sample_rate)
        planes = decode_raw_pcm(buf[:usable], self.fmt)
        mono = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
        return self._rs.process(mono)

    def finish(self) -> np.ndarray:
        if self._pending:
            n = len(self._pending)
            self._pending = b""
            raise BadAudioError(
                f"the raw {self.fmt.encoding} stream ended inside a sample frame ({n} stray "
                f"bytes); send whole frames of {self.fmt.bytes_per_frame} bytes"
            )
        return self._rs.flush()


# --------------------------------------------------------------------------------------------
# Container decoding


def _describe(source: Any) -> str:
    if isinstance(source, (str, os.PathLike)):
        return repr(os.fspath(source))
    if isinstance(source, (bytes, bytearray, memoryview)):
        return f"<{len(memoryview(source).cast('B'))} bytes>"
    return f"<{type(source).__name__}>"


class _Budget:
    def __init__(self, sample_rate: int, max_seconds: float | None, timeout_s: float | None):
        self.limit_s = HARD_MAX_SECONDS if max_seconds is None else float(max_seconds)
        self.user_limit = max_seconds is not None
        self.decoded_s = 0.0
        self.deadline = None if timeout_s is None else time.monotonic() + float(timeout_s)
        self.timeout_s = timeout_s

    def add(self, seconds: float) -> None:
        self.decoded_s += seconds
        if self.decoded_s > self.limit_s + LENGTH_SLACK_S:
            if self.user_limit:
                raise AudioTooLongError(
                    f"audio is longer than the limit of {self.limit_s:g} s; send a shorter clip "
                    f"or raise max_seconds"
                )
            raise AudioTooLongError(
                f"audio is longer than the hard cap of {self.limit_s:g} s; split it into parts"
            )
        self.check_time()

    def check_time(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise BadAudioError(
                f"decoding took longer than {self.timeout_s:g} s; the file is probably corrupt "
                f"or far too long (re-encode it, or raise timeout_s)"
            )


def _frame_to_mono(frame: Any) -> np.ndarray:
    """A resampled packed-'flt' frame of any channel count -> mono float32 by channel averaging.

    Packed (interleaved) output keeps one data plane whatever the channel count: PyAV's planar
    ``to_ndarray`` crashes for frames with 8 or more planes, so planar output is never used.
    """
    channels = len(frame.layout.channels)
    arr = frame.to_ndarray().reshape(-1)
    if channels <= 1:
        return arr.astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore"):  # corrupt float data: caught as non-finite
        return arr.reshape(-1, channels).mean(axis=1, dtype=np.float32)


def _open_container(av: Any, source: Any) -> Any:
    """``av.open`` for reading, tolerant of undecodable metadata on every PyAV we support: PyAV
    18 and older take ``metadata_errors="ignore"``; PyAV 19 dropped the argument (and no longer
    fails on such tags), so it is passed only where it is accepted."""
    if _AV_METADATA_ERRORS[0]:
        try:
            return av.open(source, mode="r", metadata_errors="ignore")
        except TypeError as e:
            if "metadata_errors" not in str(e):
                raise
            _AV_METADATA_ERRORS[0] = False
    return av.open(source, mode="r")


#: whether this PyAV's ``av.open`` takes ``metadata_errors`` (learnt on the first call)
_AV_METADATA_ERRORS = [True]


def _declared_seconds(stream: Any) -> float | None:
    """The audio stream's duration from its header, when the container states it (not an
    estimate from the bit rate); None when unknown."""
    try:
        duration, base = stream.duration, stream.time_base
        if duration is None or base is None or duration <= 0:
            return None
        return float(duration * base)
    except (AttributeError, TypeError, ValueError, ZeroDivisionError):
        return None


def _decode_container(
    source: Any, sample_rate: int, budget: _Budget, name: str
) -> np.ndarray:
    import av

    try:
        container = _open_container(av, source)
    except av.FFmpegError as e:
        raise BadAudioError(
            f"could not open {name} as audio: {_ffmsg(e)}; the data is not a supported "
            f"audio/video container (or it is truncated/corrupt)"
        ) from None
    with container:
        streams = container.streams.audio
        if not streams:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise BadAudioError(
                f"{name} has no audio stream (detected format {container.format.name!r}, "
                f"streams: {', '.join(kinds)}); send an audio file"
            )
        stream = streams[0]
        ctx = stream.codec_context
        if ctx is None or stream.codec_context.codec is None:
            raise BadAudioError(f"{name}: the audio codec is not supported by this FFmpeg build")
        _check_params(getattr(ctx, "sample_rate", 0) or 0, getattr(ctx, "channels", 0) or 0, name,
                      strict=False)
        declared = _declared_seconds(stream)
        too_long = declared is not None and declared > budget.limit_s + LENGTH_SLACK_S
        if budget.user_limit and too_long:
            # the header says so (FLAC STREAMINFO, WAV, MP4): refused before any decoding work,
            # with the message a decode that reached the limit gives
            raise AudioTooLongError(
                f"audio is longer than the limit of {budget.limit_s:g} s; send a shorter clip "
                f"or raise max_seconds"
            )
        chunks: list[np.ndarray] = []
        resampler = None
        rs_key: tuple | None = None

        def push(frame: Any) -> None:
            nonlocal resampler, rs_key
            rate = frame.sample_rate
            ch = len(frame.layout.channels)
            _check_params(rate, ch, name, strict=True)
            budget.add(frame.samples / rate)
            key = (rate, frame.layout.name, frame.format.name)
            if resampler is None or key != rs_key:
                if resampler is not None:
                    for f in resampler.resample(None):
                        chunks.append(_frame_to_mono(f))
                resampler = av.AudioResampler(format="flt", rate=sample_rate)
                rs_key = key
            frame.pts = None
            for f in resampler.resample(frame):
                chunks.append(_frame_to_mono(f))

        try:
            for packet in container.demux(stream):
                budget.check_time()
                for frame in packet.decode():
                    push(frame)
            if resampler is not None:
                for f in resampler.resample(None):
                    chunks.append(_frame_to_mono(f))
        except av.FFmpegError as e:
            if not chunks:
                raise BadAudioError(
                    f"could not decode {name}: {_ffmsg(e)}; the file is corrupt, truncated or "
                    f"uses an unsupported codec"
                ) from None
            # Corruption after some audio decoded: keep what decoded (as ffmpeg does).
    if not chunks:
        raise BadAudioError(f"{name} contains no audio samples (zero-length audio)")
    return np.concatenate(chunks)


def _check_params(rate: int, channels: int, name: str, *, strict: bool) -> None:
    if strict or rate:
        if not (MIN_RATE <= rate <= MAX_RATE):
            raise BadAudioError(
                f"{name} declares a sample rate of {rate} Hz, outside [{MIN_RATE}, {MAX_RATE}] "
                f"Hz; the header is corrupt"
            )
    if strict or channels:
        if not (1 <= channels <= MAX_CHANNELS):
            raise BadAudioError(
                f"{name} declares {channels} channels, outside [1, {MAX_CHANNELS}]; the header "
                f"is corrupt"
            )


def _ffmsg(e: BaseException) -> str:
    msg = getattr(e, "strerror", None) or str(e)
    return str(msg).strip() or type(e).__name__


def _read_source(source: Any, name: str) -> bytes:
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        try:
            return p.read_bytes()
        except FileNotFoundError:
            raise BadAudioError(f"audio file {name} does not exist") from None
        except IsADirectoryError:
            raise BadAudioError(f"{name} is a directory, not an audio file") from None
        except OSError as e:
            raise BadAudioError(f"cannot read audio file {name}: {e.strerror or e}") from None
    if isinstance(source, (bytes, bytearray, memoryview)):
        return bytes(source)
    data = source.read()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidRequestError(
            "the file object must be opened in binary mode (read() returned text)",
            param="source",
        )
    return bytes(data)


# --------------------------------------------------------------------------------------------
# WAV fast path
#
# PyAV costs ~65 us of GIL-held Python per packet, so a plain 16-bit PCM / 32-bit float WAV that is
# already at the target rate is read here with numpy instead. Its result must be bit-identical to
# the PyAV path's, so anything this parser does not fully account for returns None and takes the
# PyAV path: besides the header fields, the checks below cover the ways in which FFmpeg would read
# the same bytes differently (its chunk walk, its format probe and its codec sniffing).

_WAV_FAST_PATH = True  # tests turn this off to get the PyAV path
#: Larger files take the PyAV path, which streams: the fast path holds the file plus its floats.
_WAV_FAST_MAX_BYTES = 1 << 28
#: SubFormat GUID of WAVE_FORMAT_EXTENSIBLE after its 4-byte format tag (KSDATAFORMAT_SUBTYPE_*).
_GUID_TAIL = b"\x00\x00\x10\x00\x80\x00\x00\xaa\x00\x38\x9b\x71"
#: Chunks FFmpeg skips or only takes metadata from. Others may change the result or fail it
#: ('bext', 'cue ', 'ID3 ', 'SMV0' (video), 'XMA2', a second 'fmt '/'data': FFmpeg decodes every
#: 'data' chunk), so they take the PyAV path.
_INERT_CHUNKS = frozenset({b"LIST", b"list", b"fact", b"JUNK", b"junk", b"PAD ", b"FLLR", b"PEAK"})
#: DTS sync words (the core sync in its four byte layouts, the substream sync) as little-endian
#: 32-bit words.
_DTS_SYNCS = [int.from_bytes(bytes.fromhex(h), "little")
              for h in ("7ffe8001", "fe7f0180", "1fffe800", "ff1f00e8", "64582025")]
_MXF_KEY = bytes.fromhex("060e2b34020501010d010201")  # MXF partition pack key
#: A RIFF size field that reads as one of these atoms makes FFmpeg's MOV probe outscore WAV.
_MOV_ATOMS = frozenset({b"moov", b"mdat", b"pnot", b"udta", b"ftyp"})
#: Characters that make FFmpeg treat a file name as a protocol (``x:``) or an image pattern.
_FFMPEG_NAME_CHARS = frozenset(":%*?[{")


#: MPEG audio bit rates in kbit/s by [MPEG-2/2.5][layer - 1][index] (ISO 11172-3, 13818-3).
_MPA_KBPS = (
    ((0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
     (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
     (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)),
    ((0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
     (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
     (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)),
)


def _mpa_frame_size(h: bytes) -> int:
    """Size of the MPEG audio frame whose header starts ``h``; 0 where FFmpeg rejects it."""
    if len(h) < 4 or h[0] != 0xFF or h[1] < 0xE0:
        return 0
    version, layer, kbps, rate = (h[1] >> 3) & 3, 4 - ((h[1] >> 1) & 3), h[2] >> 4, (h[2] >> 2) & 3
    if version == 1 or layer == 4 or kbps in (0, 15) or rate == 3:  # reserved, free format, bad
        return 0
    lsf = version != 3
    rate = (44100, 48000, 32000)[rate] >> (lsf + (version == 0))
    kbps = _MPA_KBPS[lsf][layer - 1][kbps]
    pad = (h[2] >> 1) & 1
    if layer == 1:
        return (kbps * 12000 // rate + pad) * 4
    return kbps * 144000 // (rate << (lsf and layer == 3)) + pad


def _starts_like_bitstream(d: bytes) -> bool:
    """Does ``d`` begin like an MPEG audio, ADTS, AC-3, LATM or ID3-tagged stream?

    FFmpeg sniffs the first packets of 16-bit PCM WAV data and decodes them as such a codec when
    its frames chain from the start (measured: MP2, MP3, AC-3, E-AC-3, ADTS and LATM streams in a
    PCM WAV). For MPEG audio it needs 7 chained frames: two are checked here, so that speech
    starting with small samples (FF FF ..) keeps the fast path.
    """
    if d[:3] == b"ID3" or d[:2] in (b"\x0b\x77", b"\x77\x0b"):
        return True
    if len(d) > 1 and d[1] >= 0xE0 and (d[0] == 0x56 or d[0] == 0xFF and not d[1] & 0x06):
        return True  # LATM sync, ADTS sync (MPEG layer bits 0)
    size = _mpa_frame_size(d)
    return size > 0 and _mpa_frame_size(d[size : size + 4]) > 0


def _foreign_bitstream(data: bytes, data_start: int, end: int) -> bool:
    """Could FFmpeg read the WAV ``data`` as something other than PCM, from what it probes?

    ``end`` bounds what its probes read. Its S/PDIF check reads IEC 61937 data after 2 burst
    preambles. Its codec sniffing of 16-bit PCM may take one TrueHD major sync (after a long
    enough chain of frame lengths), 4 DTS sync words of one kind at even offsets of the data (so
    the odd one in speech does not count) or an MP3/ADTS/AC-3/LATM/ID3 frame at the start of the
    data. The MXF probe ties with the WAV probe on an MXF key in the first 2 KiB.
    """
    if data.count(b"\x72\xf8\x1f\x4e", 0, end) >= 2 or data.find(b"\xf8\x72\x6f\xba", 0, end) >= 0:
        return True
    if data.find(_MXF_KEY, 0, 2048) >= 0:
        return True
    dts = [0] * len(_DTS_SYNCS)
    for start in (data_start, data_start + 2):
        words = np.frombuffer(data, "<u4", max(0, end - start) // 4, start)
        for i, sync in enumerate(_DTS_SYNCS):
            dts[i] += np.count_nonzero(words == sync)
    head = data[data_start:end]
    return max(dts) >= 4 or _starts_like_bitstream(head) or _starts_like_bitstream(
        head.lstrip(b"\0")  # (the MP3 probe skips leading zero bytes)
    )


def _decode_wav(data: bytes, sample_rate: int, budget: _Budget) -> np.ndarray | None:
    """A 16-bit PCM / 32-bit float, mono/stereo WAV at ``sample_rate`` -> float32 mono, else None.

    When it returns an array, the array is bit-identical to what :func:`_decode_container` returns
    for the same bytes, and the budget raises the same errors; None means "use PyAV".
    """
    n = len(data)
    if n < 44 or data[:4] != b"RIFF" or data[8:12] != b"WAVE" or data[4:8] in _MOV_ATOMS:
        return None
    if n >= 512 and data[256] == 0x84 and not data[44:256].strip(b"\0"):
        return None  # the ACT demuxer's signature (a WAV header, zeros, 0x84 at byte 256)
    # Walk the chunks as FFmpeg does (each padded to an even size).
    fmt = body = None
    pos = 12
    for _ in range(64):
        if n - pos < 8:
            break
        tag, size = struct.unpack_from("<4sI", data, pos)
        start, end = pos + 8, pos + 8 + size
        if tag == b"fmt " and fmt is None and body is None and end <= n:
            fmt = (start, size)
        elif tag == b"data" and body is None and fmt is not None and 0 < size and end <= n:
            body = (start, size)  # a size of 0 or 0xFFFFFFFF means "to EOF" to FFmpeg: PyAV path
        elif tag not in _INERT_CHUNKS or (tag in (b"LIST", b"list") and size < 4):
            return None
        elif body is None and end >= n:
            return None  # FFmpeg stops walking at a chunk that reaches EOF: no data for it
        pos = end + (end & 1)
    else:
        return None  # absurdly many chunks
    # FFmpeg looks for more 'data' after the data chunk, even in a truncated chunk header.
    if fmt is None or body is None or data[pos : pos + 4] == b"data":
        return None

    fmt_start, fmt_size = fmt
    if fmt_size < 16:
        return None
    tag, channels, rate, _, align, bits = struct.unpack_from("<HHIIHH", data, fmt_start)
    if tag == 0xFFFE and fmt_size >= 40:
        cb_size, valid_bits, _, guid = struct.unpack_from("<HHI16s", data, fmt_start + 16)
        if cb_size >= 22 and valid_bits == bits and guid[4:] == _GUID_TAIL:
            tag = int.from_bytes(guid[:4], "little")
    if (tag, bits) not in ((1, 16), (3, 32)):
        return None
    # 1-2 channels only: for more, libswresample may reorder them and the float mean would
    # change. The rate must be the target (no resampling here); both imply _check_params passes.
    if channels not in (1, 2) or rate != sample_rate or align != channels * bits // 8:
        return None
    data_start, data_size = body
    if data_size % align:
        return None
    # FFmpeg's PCM packets hold 2**floor(log2(rate / 10)) frames. Its format probe reads the
    # first 2 KiB; for 16-bit PCM, its S/PDIF check also reads the first 64 KiB of the data and
    # its codec sniffing the first 32 packets.
    packet = 1 << ((rate // 10).bit_length() - 1)
    end = 2048 if bits == 32 else data_start + max(1 << 16, 32 * packet * align)
    if _foreign_bitstream(data, data_start, min(n, end)):
        return None

    # The budget sees the same float sums as the PyAV path, which adds each decoded packet's
    # duration in turn: np.add.accumulate adds sequentially, and a running sum of positive
    # steps exceeds the limit at some point iff its final value does.
    if budget.decoded_s:
        return None  # (load_audio's budget is fresh)
    frames = data_size // align
    steps = np.full(-(-frames // packet), packet / rate)
    if frames % packet:
        steps[-1] = frames % packet / rate
    budget.add(float(np.add.accumulate(steps)[-1]))

    x = np.frombuffer(data, "<i2" if bits == 16 else "<f4", frames * channels, data_start)
    y = x.astype(np.float32)  # a fresh, writable copy, never a view of the caller's bytes
    if bits == 16:
        y /= np.float32(32768)  # = libswresample's s16 -> flt (exact multiply by 2**-15)
    if channels == 2:
        # = _frame_to_mono's mean(axis=1, dtype=float32): a float32 sum of the two channels, then
        # a correctly rounded halving (numpy divides in float64, exactly, and rounds once), but
        # without numpy's per-row reduction overhead (10x slower here).
        with np.errstate(over="ignore", invalid="ignore"):
            y = (y[0::2] + y[1::2]) / np.float32(2)
    return y


def _read_wav_file(path: str, size: int, sample_rate: int) -> bytes | None:
    """The bytes of a file that may be a WAV for the fast path, else None (PyAV reads it)."""
    if size > _WAV_FAST_MAX_BYTES or _FFMPEG_NAME_CHARS.intersection(path):
        return None
    try:
        with open(path, "rb") as f:
            head = f.read(28)
            if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
                return None
            if head[12:16] == b"fmt " and int.from_bytes(head[24:28], "little") != sample_rate:
                return None  # the usual layout at another rate: no need to read it all twice
            f.seek(0)
            return f.read()
    except OSError:
        return None  # the PyAV path reports it in its own words


def load_audio(
    source: Source,
    sample_rate: int = 16000,
    *,
    max_seconds: float | None = None,
    raw_format: RawPCMFormat | None = None,
    timeout_s: float | None = DEFAULT_TIMEOUT_S,
) -> np.ndarray:
    """Decode ``source`` to a float32 mono numpy array at ``sample_rate`` Hz.

    ``source`` is a path, bytes-like, or a binary file object holding any container FFmpeg can
    demux (WAV/AIFF PCM, G.711, float; FLAC; MP3; AAC/M4A; OGG Vorbis/Opus; WebM; ...), or headerless
    PCM described by ``raw_format``. Channels are averaged; the rate is converted.

    Raises :class:`BadAudioError` (undecodable, empty, corrupt, not audio, absurd header, too slow)
    or :class:`AudioTooLongError` (more than ``max_seconds`` decoded).
    """
    if not isinstance(sample_rate, (int, np.integer)) or not MIN_RATE <= sample_rate <= MAX_RATE:
        raise InvalidRequestError(
            f"sample_rate must be an integer in [{MIN_RATE}, {MAX_RATE}], not {sample_rate!r}",
            param="sample_rate",
        )
    sample_rate = int(sample_rate)
    if max_seconds is not None and not max_seconds > 0:
        raise InvalidRequestError("max_seconds must be > 0", param="max_seconds")
    name = _describe(source)
    budget = _Budget(sample_rate, max_seconds, timeout_s)

    if raw_format is not None:
        data = _read_source(source, name)
        if not data:
            raise BadAudioError(f"{name} is empty (0 bytes); send some audio")
        n_frames = len(data) // raw_format.bytes_per_frame
        budget.add(n_frames / raw_format.sample_rate)
        planes = decode_raw_pcm(data, raw_format)
        mono = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
        out = resample(mono, raw_format.sample_rate, sample_rate)
        if out.size == 0:
            raise BadAudioError(f"{name} contains no audio samples (zero-length audio)")
        return out

    wav: bytes | None = None  # the bytes of a possible WAV for the numpy fast path
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if not p.exists():
            raise BadAudioError(f"audio file {name} does not exist")
        if p.is_dir():
            raise BadAudioError(f"{name} is a directory, not an audio file")
        size = p.stat().st_size
        if size == 0:
            raise BadAudioError(f"audio file {name} is empty (0 bytes)")
        av_source: Any = os.fspath(p)
        if _WAV_FAST_PATH:
            wav = _read_wav_file(av_source, size, sample_rate)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(memoryview(source).cast("B")) == 0:
            raise BadAudioError("the audio data is empty (0 bytes); send some audio")
        data = bytes(source)
        av_source = io.BytesIO(data)
        if _WAV_FAST_PATH and len(data) <= _WAV_FAST_MAX_BYTES:
            wav = data
    elif hasattr(source, "read"):
        av_source = source
        if hasattr(source, "mode") and "b" not in str(getattr(source, "mode", "b")):
            raise InvalidRequestError(
                "the file object must be opened in binary mode ('rb')", param="source"
            )
        if isinstance(source, io.TextIOBase):
            raise InvalidRequestError(
                "the file object must be opened in binary mode ('rb')", param="source"
            )
    else:
        raise InvalidRequestError(
            f"source must be a path, bytes or a binary file object, not {type(source).__name__}",
            param="source",
        )

    try:
        out = None if wav is None else _decode_wav(wav, sample_rate, budget)
        if out is None:
            out = _decode_container(av_source, sample_rate, budget, name)
    except (BadAudioError, AudioTooLongError, InvalidRequestError):
        raise
    except MemoryError:
        raise BadAudioError(f"{name} needs more memory to decode than is available") from None
    except Exception as e:  # any other decoder failure is still "bad audio", never a crash
        raise BadAudioError(
            f"could not decode {name}: {type(e).__name__}: {e}; the file is corrupt or not audio"
        ) from None
    if not np.isfinite(out).all():
        raise BadAudioError(f"{name} decodes to NaN or infinite samples; the file is corrupt")
    return out

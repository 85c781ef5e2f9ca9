"""Helpers for the audio tests: the container cases, the reference, SNR alignment."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.signal import resample_poly

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
CLIP_S = 3.0


@dataclass(frozen=True)
class Case:
    name: str
    container: str
    codec: str
    source: str  # key into the sources dict
    out_rate: int | None = None
    bit_rate: int | None = None
    lossy: bool = False


# (file name, container, codec, source, encoder rate, bit rate, lossy)
CASES = [
    Case("pcm16.wav", "wav", "pcm_s16le", "stereo44k"),
    Case("pcm24.wav", "wav", "pcm_s24le", "stereo44k"),
    Case("pcm32.wav", "wav", "pcm_s32le", "mono16k"),
    Case("float.wav", "wav", "pcm_f32le", "mono16k"),
    Case("f64.wav", "wav", "pcm_f64le", "mono16k"),
    Case("mulaw8k.wav", "wav", "pcm_mulaw", "mono16k", out_rate=8000),
    Case("alaw8k.wav", "wav", "pcm_alaw", "stereo44k", out_rate=8000),
    Case("pcm22k.wav", "wav", "pcm_s16le", "mono16k", out_rate=22050),
    Case("pcm48k.aiff", "aiff", "pcm_s16be", "stereo44k", out_rate=48000),
    Case("flac.flac", "flac", "flac", "stereo44k"),
    Case("flac8k.flac", "flac", "flac", "mono16k", out_rate=8000),
    Case("flac96k.flac", "flac", "flac", "stereo44k", out_rate=96000),
    Case("pcm11k.wav", "wav", "pcm_s16le", "stereo44k", out_rate=11025),
    Case("mp3.mp3", "mp3", "libmp3lame", "stereo44k", bit_rate=128000, lossy=True),
    Case("mp3_16k.mp3", "mp3", "libmp3lame", "mono16k", bit_rate=64000, lossy=True),
    Case("aac.m4a", "ipod", "aac", "stereo44k", bit_rate=128000, lossy=True),
    Case("vorbis.ogg", "ogg", "vorbis", "stereo44k", lossy=True),
    Case("opus.ogg", "ogg", "libopus", "mono16k", out_rate=48000, bit_rate=64000, lossy=True),
    Case("opus.webm", "webm", "libopus", "stereo44k", out_rate=48000, bit_rate=64000, lossy=True),
    Case("vorbis.webm", "webm", "vorbis", "stereo44k", lossy=True)  # encoder: stereo only,
]


def reference(sources, case: Case, target: int = 16000) -> np.ndarray:
    """Independent reference: channel mean, through the encoder's rate, scipy polyphase."""
    x, sr = sources[case.source]
    mono = x.mean(axis=0).astype(np.float64)
    if case.out_rate and case.out_rate != sr:
        g = np.gcd(sr, case.out_rate)
        mono = resample_poly(mono, case.out_rate // g, sr // g)
        sr = case.out_rate
    g = np.gcd(sr, target)
    return resample_poly(mono, target // g, sr // g).astype(np.float32)


def align_snr(ref: np.ndarray, y: np.ndarray, max_lag: int = 4000) -> tuple[float, float, int]:
    """Best-lag alignment; returns (SNR dB, correlation, lag) over the overlapping part."""
    n = min(len(ref), len(y))
    r = ref[:n].astype(np.float64)
    best = (-np.inf, 0.0, 0)
    yy = y.astype(np.float64)
    spec = np.fft.irfft(np.fft.rfft(yy, 2 * len(yy)) * np.conj(np.fft.rfft(r, 2 * len(yy))))
    lags = list(range(0, max_lag + 1)) + list(range(-max_lag, 0))
    lag = max(lags, key=lambda k: spec[k])
    if lag >= 0:
        a, b = r[: len(yy) - lag], yy[lag:]
    else:
        a, b = r[-lag:], yy[: len(yy) + lag]
    m = min(len(a), len(b))
    a, b = a[:m], b[:m]
    err = a - b
    snr = 10 * np.log10(np.sum(a * a) / max(np.sum(err * err), 1e-20))
    corr = float(np.dot(a, b) / np.sqrt(np.dot(a, a) * np.dot(b, b)))
    best = (float(snr), corr, lag)
    return best

"""Shared pieces of the feature frontends: windows, mel filterbanks (input batching is public:
:mod:`oasr.features.batching`)."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from oasr.errors import InvalidRequestError

FLT_EPSILON = float(np.finfo(np.float32).eps)  # 1.1920929e-07, Kaldi's log floor


# ---------------------------------------------------------------------------------------------
# Windows (Kaldi's FeatureWindowFunction definitions, symmetric, N - 1 in the denominator)


@functools.lru_cache(maxsize=16)
def _kaldi_window_np(window_type: str, length: int, blackman_coeff: float = 0.42) -> np.ndarray:
    i = np.arange(length, dtype=np.float64)
    a = 2 * math.pi / (length - 1) if length > 1 else 0.0
    if window_type == "hanning":
        w = 0.5 - 0.5 * np.cos(a * i)
    elif window_type == "sine":
        w = np.sin(0.5 * a * i)
    elif window_type == "hamming":
        w = 0.54 - 0.46 * np.cos(a * i)
    elif window_type == "povey":
        w = (0.5 - 0.5 * np.cos(a * i)) ** 0.85
    elif window_type == "rectangular":
        w = np.ones(length)
    elif window_type == "blackman":
        w = blackman_coeff - 0.5 * np.cos(a * i) + (0.5 - blackman_coeff) * np.cos(2 * a * i)
    else:
        raise InvalidRequestError(
            f"unknown window_type {window_type!r}; use povey, hamming, hanning, sine, "
            f"rectangular or blackman",
            param="window_type",
        )
    return w.astype(np.float32)


def kaldi_window(window_type: str, length: int, device: torch.device | str = "cpu",
                 blackman_coeff: float = 0.42) -> torch.Tensor:
    return torch.from_numpy(_kaldi_window_np(window_type, length, blackman_coeff)).to(device)


# ---------------------------------------------------------------------------------------------
# Mel filterbanks


def _kaldi_mel(f: np.ndarray | float) -> np.ndarray:
    return 1127.0 * np.log(1.0 + np.asarray(f, dtype=np.float64) / 700.0)


@functools.lru_cache(maxsize=16)
def kaldi_mel_banks_np(
    num_bins: int, n_fft: int, sample_rate: float, low_freq: float, high_freq: float
) -> np.ndarray:
    """Kaldi's triangular mel banks (HTK mel scale, triangles in the mel domain, unnormalised).

    Returns (n_fft // 2 + 1, num_bins); the Nyquist row is zero, as Kaldi uses n_fft / 2 bins.
    """
    nyquist = 0.5 * sample_rate
    if high_freq <= 0.0:
        high_freq = nyquist + high_freq
    if not (0.0 <= low_freq < nyquist and 0.0 < high_freq <= nyquist and low_freq < high_freq):
        raise InvalidRequestError(
            f"bad mel frequency range low_freq={low_freq}, high_freq={high_freq} for sample rate "
            f"{sample_rate}: need 0 <= low < high <= {nyquist}",
            param="high_freq",
        )
    n_bins_fft = n_fft // 2
    fft_bin_width = sample_rate / n_fft
    mel_low, mel_high = _kaldi_mel(low_freq), _kaldi_mel(high_freq)
    delta = (mel_high - mel_low) / (num_bins + 1)
    b = np.arange(num_bins, dtype=np.float64)[None, :]
    left, center, right = mel_low + b * delta, mel_low + (b + 1) * delta, mel_low + (b + 2) * delta
    mel = _kaldi_mel(fft_bin_width * np.arange(n_bins_fft, dtype=np.float64))[:, None]
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    w = np.where((mel > left) & (mel < right), np.where(mel <= center, up, down), 0.0)
    out = np.zeros((n_bins_fft + 1, num_bins), dtype=np.float32)
    out[:n_bins_fft] = w
    return out


def _slaney_hz_to_mel(f: np.ndarray) -> np.ndarray:
    f = np.asarray(f, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.where(
        f >= min_log_hz,
        min_log_mel + np.log(np.maximum(f, 1e-10) / min_log_hz) / logstep,
        f / f_sp,
    )


def _slaney_mel_to_hz(m: np.ndarray) -> np.ndarray:
    m = np.asarray(m, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, logstep = 1000.0, math.log(6.4) / 27.0
    min_log_mel = min_log_hz / f_sp
    return np.where(m >= min_log_mel, min_log_hz * np.exp(logstep * (m - min_log_mel)), f_sp * m)


@functools.lru_cache(maxsize=16)
def slaney_mel_filters_np(
    n_mels: int, sample_rate: int, n_fft: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """librosa-style Slaney-scale, Slaney-normalised filters, shape (n_mels, n_fft // 2 + 1)."""
    fmax = sample_rate / 2 if fmax is None else float(fmax)
    fftfreqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    pts = _slaney_mel_to_hz(
        np.linspace(_slaney_hz_to_mel(fmin), _slaney_hz_to_mel(fmax), n_mels + 2)
    )
    fdiff = np.diff(pts)
    ramps = pts[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    w = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (pts[2 : n_mels + 2] - pts[:n_mels])
    return (w * enorm[:, None]).astype(np.float32)


def next_pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()

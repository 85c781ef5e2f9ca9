"""Shared pieces of the feature frontends: input batching, windows, mel filterbanks."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Sequence

import numpy as np
import torch

from oasr.errors import InvalidRequestError

FLT_EPSILON = float(np.finfo(np.float32).eps)  # 1.1920929e-07, Kaldi's log floor


def as_batch(
    audio: torch.Tensor | np.ndarray | list, lengths: torch.Tensor | list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Waveform(s) -> ((B, T) float32 tensor, (B,) int64 lengths on the same device, was_1d).

    Accepts a (T,) or (B, T) tensor/array, or a list of 1-D waveforms (zero-padded here).
    """
    if isinstance(audio, (list, tuple)):
        items = [torch.as_tensor(a).reshape(-1) for a in audio]
        if not items:
            raise InvalidRequestError("empty batch of waveforms", param="audio")
        device = items[0].device
        n = max(int(a.shape[0]) for a in items)
        x = torch.zeros(len(items), n, dtype=torch.float32, device=device)
        for i, a in enumerate(items):
            x[i, : a.shape[0]] = a.to(device=device, dtype=torch.float32)
        lens = torch.tensor([a.shape[0] for a in items], dtype=torch.long, device=device)
        if lengths is not None:
            lens = torch.as_tensor(lengths, dtype=torch.long, device=device)
        return x, lens, False
    x = torch.as_tensor(audio)
    if x.dtype != torch.float32:
        x = x.float()
    was_1d = x.dim() == 1
    if was_1d:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise InvalidRequestError(
            f"waveforms must be (T,) or (B, T), got shape {tuple(x.shape)}; down-mix first",
            param="audio",
        )
    if lengths is None:
        lens = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    else:
        lens = torch.as_tensor(lengths, dtype=torch.long, device=x.device).reshape(-1)
        if lens.shape[0] != x.shape[0]:
            raise InvalidRequestError(
                f"{lens.shape[0]} lengths for {x.shape[0]} waveforms", param="lengths"
            )
    return x, lens, was_1d


class _PinnedStaging(threading.local):
    """One page-locked host buffer per thread (the model thread reuses it call after call) and
    the event of the copy that last read it, so it is not overwritten while in flight."""

    buffer: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


_staging = _PinnedStaging()


def padded_batch(
    waves: Sequence[np.ndarray], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms -> ((B, T) float32 zero-padded batch, (B,) int64 lengths), both on ``device``.

    On CUDA the batch goes through a reused page-locked buffer in one asynchronous copy: a
    pageable copy of a batch of 30 s inputs stages tens of megabytes through the driver and
    zero-filling a fresh padded tensor costs as much again, which the host pays before every
    model call (what each family used to do)."""
    if not waves:
        raise InvalidRequestError("empty batch of waveforms", param="audio")
    dev = torch.device(device)
    lens = [int(len(w)) for w in waves]
    b, n = len(waves), max(lens)
    if dev.type != "cuda":
        host = np.zeros((b, n), dtype=np.float32)
        for i, w in enumerate(waves):
            host[i, : lens[i]] = w
        return torch.from_numpy(host).to(dev), torch.tensor(lens, dtype=torch.long, device=dev)
    need = b * n
    st = _staging
    if st.event is not None:
        st.event.synchronize()  # the previous batch's copy has left the buffer
    if st.buffer is None or st.buffer.numel() < need:
        st.buffer = torch.empty(max(need, 1 << 20), dtype=torch.float32, pin_memory=True)
    flat = st.buffer[: b * n]
    rows = flat.numpy().reshape(b, n)
    for i, w in enumerate(waves):
        rows[i, : lens[i]] = w
        rows[i, lens[i] :] = 0.0
    x = flat.view(b, n).to(dev, non_blocking=True)
    st.event = torch.cuda.Event()
    st.event.record()
    # pin_memory() comes from torch's caching host allocator, which keeps the block until the
    # copy is done
    lengths = torch.tensor(lens, dtype=torch.long).pin_memory().to(dev, non_blocking=True)
    return x, lengths


def mask_frames(feats: torch.Tensor, frame_lengths: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """Set frames at or beyond each item's length to ``value``; feats is (B, F, D)."""
    f = feats.shape[1]
    mask = torch.arange(f, device=feats.device)[None, :] >= frame_lengths[:, None]
    return feats.masked_fill(mask[:, :, None], value)


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

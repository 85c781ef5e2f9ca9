"""Whisper's log-mel frontend (80 or 128 bins), numerically matching openai-whisper.

STFT with a periodic Hann window of 400 samples, hop 160, reflect padding; the last frame is
dropped; Slaney mel filters; log10 clamped to 1e-10, then floored at (max - 8) and scaled
``(x + 4) / 4``. Whisper pads every window to 30 s (480000 samples, 3000 frames).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from oasr.types import FeatureSpec

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_SAMPLES = CHUNK_SECONDS * SAMPLE_RATE  # 480000
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000


def _hz_to_mel(freq: np.ndarray) -> np.ndarray:
    # Slaney scale: linear below 1 kHz, logarithmic above (librosa's htk=False).
    f_sp = 200.0 / 3
    mels = freq / f_sp
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    log_region = freq >= min_log_hz
    mels = np.where(log_region, min_log_mel + np.log(np.maximum(freq, 1e-10) / min_log_hz) / logstep, mels)
    return mels


def _mel_to_hz(mels: np.ndarray) -> np.ndarray:
    f_sp = 200.0 / 3
    freqs = f_sp * mels
    min_log_hz = 1000.0
    min_log_mel = min_log_hz / f_sp
    logstep = np.log(6.4) / 27.0
    log_region = mels >= min_log_mel
    return np.where(log_region, min_log_hz * np.exp(logstep * (mels - min_log_mel)), freqs)


@functools.lru_cache(maxsize=8)
def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-normalised mel filterbank, shape (n_mels, n_fft // 2 + 1), as librosa builds it."""
    fftfreqs = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    mel_pts = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(sample_rate / 2)), n_mels + 2))
    fdiff = np.diff(mel_pts)
    ramps = mel_pts[:, None] - fftfreqs[None, :]
    lower = -ramps[:-2] / fdiff[:-1, None]
    upper = ramps[2:] / fdiff[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_pts[2 : n_mels + 2] - mel_pts[:n_mels])
    return (weights * enorm[:, None]).astype(np.float32)


def log_mel_spectrogram(
    audio: torch.Tensor | np.ndarray, n_mels: int = 80, padding: int = 0
) -> torch.Tensor:
    """Log-mel of a (T,) or (B, T) waveform at 16 kHz -> (n_mels, frames) or (B, n_mels, frames).

    Runs on the waveform's device (CPU or CUDA), batched, with no host round-trips.
    """
    from oasr.layers.fused import log_mel_power

    x = torch.as_tensor(audio)
    if x.dtype != torch.float32:
        x = x.float()
    if padding > 0:
        x = torch.nn.functional.pad(x, (0, padding))
    window = torch.hann_window(N_FFT, device=x.device)
    stft = torch.stft(x, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    filters = torch.from_numpy(mel_filters(n_mels)).to(x.device)
    # power spectrum (the last frame dropped), mel filters, log10 clamped at 1e-10: one
    # overridable op (one kernel with oasr-kernels on CUDA)
    log_spec = log_mel_power(stft, filters, stft.shape[-1] - 1)
    peak = log_spec.amax(dim=(-2, -1), keepdim=True)
    log_spec = torch.maximum(log_spec, peak - 8.0)
    return (log_spec + 4.0) / 4.0


def pad_or_trim(mel: torch.Tensor, frames: int = N_FRAMES) -> torch.Tensor:
    """Pad (with the log-mel of silence already applied upstream) or cut the last axis."""
    n = mel.shape[-1]
    if n > frames:
        return mel[..., :frames]
    if n < frames:
        return torch.nn.functional.pad(mel, (0, frames - n))
    return mel


class WhisperLogMel:
    """Registry entry for ``FeatureSpec(kind="whisper_logmel")``."""

    def __init__(self, spec: FeatureSpec) -> None:
        self.spec = spec
        self.n_mels = spec.num_bins

    def __call__(self, audio: torch.Tensor | np.ndarray, padding: int = 0) -> torch.Tensor:
        return log_mel_spectrogram(audio, self.n_mels, padding=padding)

    @property
    def dim(self) -> int:
        return self.n_mels

    def num_frames(self, num_samples: int) -> int:
        """Frames for ``num_samples`` samples (the STFT's last frame is dropped)."""
        return num_samples // HOP_LENGTH

    def extract(
        self, audio: torch.Tensor | np.ndarray, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T) waveforms -> ((B, n_mels, frames) log-mel, (B,) frame counts ``len // 160``).

        Frame counts are informational: Whisper consumes fixed 30 s windows, so the features are
        not masked (padding is silence, exactly as openai-whisper pads).
        """
        from oasr.features.batching import as_batch

        x, lens, _ = as_batch(audio, lengths)
        mel = log_mel_spectrogram(x, self.n_mels)
        return mel, torch.div(lens, HOP_LENGTH, rounding_mode="floor")

    def stream(self, device: torch.device | str | None = None) -> None:
        """Whisper's log-mel is clamped to (max - 8) over the whole window: not streamable."""
        from oasr.errors import UnsupportedOptionError

        raise UnsupportedOptionError(
            "whisper_logmel cannot stream: its dynamic-range clamp uses the maximum over the whole "
            "30 s window; buffer audio and call the extractor on complete windows",
            param="streaming",
        )

"""NeMo / FastConformer (Parakeet, Canary, Nemotron) log-mel frontend.

Follows NeMo's ``AudioToMelSpectrogramPreprocessor`` (``FilterbankFeatures``) at inference, as
transformers' ``ParakeetFeatureExtractor`` also does:

1. pre-emphasis ``y[0] = x[0]``, ``y[t] = x[t] - 0.97 x[t-1]``, samples past each length zeroed;
2. centred STFT (zero padding of ``n_fft // 2`` both sides), ``n_fft`` 512, symmetric Hann window
   of ``win_length`` 400 centred in the FFT frame, hop 160; power spectrum (``mag_power`` 2);
3. Slaney mel filters (librosa defaults, 80 or 128 bins, ``lowfreq`` 0 .. ``highfreq`` Nyquist);
4. ``log(mel + 2**-24)``;
5. valid frames per item ``len // hop``; ``normalize="per_feature"``: each bin's mean and
   unbiased std over the valid frames, ``(x - mean) / (std + 1e-5)``; frames past the length set
   to ``pad_value`` (0); optional ``pad_to`` right-padding of the frame axis (NeMo uses 16;
   transformers uses 0).

Spec: ``FeatureSpec(kind="nemo_mel", num_bins=80|128, n_fft=512, win_length=400, hop_length=160)``
(the spec's ``n_fft`` is used as given: set 512 for NeMo models). Options: ``preemph`` (0.97 or
None), ``normalize`` ("per_feature" | "all_features" | None), ``log_zero_guard_value`` (2**-24),
``log_zero_guard_type`` ("add" or "clamp"), ``mag_power`` (2.0), ``lowfreq`` (0), ``highfreq`` (None), ``pad_to`` (0), ``pad_value`` (0.0),
``dither`` (0.0; NeMo dithers only in training), ``log`` (True).
Output is time-major (B, frames, num_bins).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.features._common import slaney_mel_filters_np
from oasr.features.batching import as_batch, mask_frames
from oasr.types import FeatureSpec

NORM_EPS = 1e-5


class NemoMel:
    """Registry entry for ``FeatureSpec(kind="nemo_mel")``."""

    def __init__(self, spec: FeatureSpec | None = None) -> None:
        spec = spec or FeatureSpec(kind="nemo_mel", n_fft=512)
        self.spec = spec
        o = spec.options
        self.sample_rate = int(spec.sample_rate)
        self.n_fft = int(spec.n_fft)
        self.win_length = int(spec.win_length)
        self.hop_length = int(spec.hop_length)
        self.num_bins = int(spec.num_bins)
        if self.win_length > self.n_fft:
            raise InvalidRequestError(
                f"nemo_mel needs n_fft >= win_length, got n_fft={self.n_fft}, win_length="
                f"{self.win_length}; NeMo models use n_fft=512",
                param="n_fft",
            )
        pre = o.get("preemph", 0.97)
        self.preemph = None if pre in (None, 0, 0.0) else float(pre)
        norm = o.get("normalize", "per_feature")
        self.normalize = None if norm in (None, "NA", "none", "") else str(norm)
        if self.normalize not in (None, "per_feature", "all_features"):
            raise UnsupportedOptionError(
                f"normalize={norm!r} is not supported; use 'per_feature', 'all_features' or None",
                param="normalize",
            )
        self.guard = float(o.get("log_zero_guard_value", 2.0**-24))
        self.guard_type = str(o.get("log_zero_guard_type", "add"))
        if self.guard_type not in ("add", "clamp"):
            raise UnsupportedOptionError(
                f"log_zero_guard_type must be 'add' or 'clamp', not {self.guard_type!r}",
                param="log_zero_guard_type",
            )
        self.mag_power = float(o.get("mag_power", 2.0))
        self.log = bool(o.get("log", True))
        self.pad_to = int(o.get("pad_to", 0) or 0)
        self.pad_value = float(o.get("pad_value", 0.0))
        self.dither = float(o.get("dither", 0.0))
        highfreq = o.get("highfreq")
        self._fb_np = slaney_mel_filters_np(
            self.num_bins, self.sample_rate, self.n_fft, float(o.get("lowfreq", 0.0) or 0.0),
            None if highfreq is None else float(highfreq),
        )
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dim(self) -> int:
        return self.num_bins

    def _consts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache.get(device)
        if c is None:
            win = torch.hann_window(self.win_length, periodic=False, device=device)
            lpad = (self.n_fft - self.win_length) // 2
            win = torch.nn.functional.pad(win, (lpad, self.n_fft - self.win_length - lpad))
            c = self._cache[device] = (win, torch.from_numpy(self._fb_np).to(device))
        return c

    def num_frames(self, num_samples: int) -> int:
        """Valid frames for ``num_samples`` samples (NeMo's ``get_seq_len``)."""
        return (num_samples + 2 * (self.n_fft // 2) - self.n_fft) // self.hop_length

    def frame_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        pad = 2 * (self.n_fft // 2)
        return torch.div(lengths + pad - self.n_fft, self.hop_length, rounding_mode="floor")

    def _preemphasis(self, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        if self.dither > 0:
            x = x + self.dither * torch.randn_like(x)
        if self.preemph is not None:
            x = torch.cat([x[:, :1], x[:, 1:] - self.preemph * x[:, :-1]], dim=1)
        mask = torch.arange(x.shape[1], device=x.device)[None, :] >= lens[:, None]
        return x.masked_fill(mask, 0.0)

    def log_mel_frames(self, frames: torch.Tensor) -> torch.Tensor:
        """(..., F, n_fft) pre-emphasised, padded sample frames -> (..., F, num_bins) log-mel."""
        win, fb = self._consts(frames.device)
        if frames.shape[-2] == 0:
            return frames.new_zeros(*frames.shape[:-1], self.num_bins)
        spec = torch.fft.rfft(frames * win, n=self.n_fft)
        mag = (spec.real.pow(2) + spec.imag.pow(2)).sqrt()
        if self.mag_power != 1.0:
            mag = mag.pow(self.mag_power)
        mel = mag @ fb.T
        if self.log:
            mel = torch.log(mel + self.guard if self.guard_type == "add" else mel.clamp_min(self.guard))
        return mel

    def _normalize(self, x: torch.Tensor, flens: torch.Tensor) -> torch.Tensor:
        if self.normalize is None:
            return x
        valid = (torch.arange(x.shape[1], device=x.device)[None, :] < flens[:, None])[:, :, None]
        xm = x * valid
        n = flens.to(x.dtype)
        if self.normalize == "per_feature":
            mean = xm.sum(1, keepdim=True) / n[:, None, None]
            var = ((xm - mean) ** 2 * valid).sum(1, keepdim=True) / (n - 1)[:, None, None]
        else:  # all_features
            cnt = n * x.shape[2]
            mean = xm.sum((1, 2), keepdim=True) / cnt[:, None, None]
            var = ((xm - mean) ** 2 * valid).sum((1, 2), keepdim=True) / (cnt - 1)[:, None, None]
        return (x - mean) / (var.sqrt() + NORM_EPS)

    def extract(
        self, audio: torch.Tensor | np.ndarray | list, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, lens, _ = as_batch(audio, lengths)
        x = self._preemphasis(x, lens)
        half = self.n_fft // 2
        xp = torch.nn.functional.pad(x, (half, half))
        frames = xp.unfold(-1, self.n_fft, self.hop_length)  # (B, T//hop + 1, n_fft)
        feats = self.log_mel_frames(frames)
        flens = self.frame_lengths(lens)
        feats = self._normalize(feats, flens)
        feats = mask_frames(feats, flens, self.pad_value)
        if self.pad_to > 0 and feats.shape[1] % self.pad_to:
            extra = self.pad_to - feats.shape[1] % self.pad_to
            feats = torch.nn.functional.pad(feats, (0, 0, 0, extra), value=self.pad_value)
        return feats, flens

    def __call__(self, audio: Any, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """(T,) -> (frames, bins) valid frames only; (B, T) -> (B, frames, bins) padded."""
        x = torch.as_tensor(audio)
        feats, flens = self.extract(x, lengths)
        if x.dim() == 1:
            n = self.num_frames(x.shape[0]) if lengths is None else int(flens[0])
            return feats[0, :n]
        return feats

    def stream(self, device: torch.device | str | None = None) -> NemoMelStream:
        return NemoMelStream(self, device)


class NemoMelStream:
    """Streaming NeMo log-mel (only without normalisation: per-utterance statistics need the
    whole signal). Emits the valid frames ``0 .. len // hop - 1`` of the offline computation."""

    def __init__(self, fe: NemoMel, device: torch.device | str | None = None) -> None:
        if fe.normalize is not None:
            raise UnsupportedOptionError(
                f"streaming nemo_mel needs normalize=None (got {fe.normalize!r}): per-utterance "
                f"normalisation uses statistics of the whole signal",
                param="normalize",
            )
        if fe.dither > 0:
            raise UnsupportedOptionError("streaming nemo_mel needs dither=0", param="dither")
        self.fe = fe
        self.device = None if device is None else torch.device(device)
        self._prev: torch.Tensor | None = None  # last raw sample (pre-emphasis state)
        self._buf: torch.Tensor | None = None  # pre-emphasised, left-padded samples from frame start
        self._seen = 0  # raw samples accepted
        self._emitted = 0

    def _ensure(self, like: torch.Tensor) -> None:
        if self._buf is None:
            self._buf = like.new_zeros(self.fe.n_fft // 2)

    def accept(self, chunk: torch.Tensor | np.ndarray) -> torch.Tensor:
        return self._log_mel(self.accept_windows(chunk))

    def accept_windows(self, chunk: torch.Tensor | np.ndarray) -> torch.Tensor:
        """:meth:`accept` before the log-mel: the new frames' pre-emphasised sample windows
        (n, n_fft), so a caller with many streams computes ``fe.log_mel_frames`` of all of
        them in one call."""
        c = torch.as_tensor(chunk)
        if self.device is not None:
            c = c.to(self.device)
        c = c.reshape(-1).to(torch.float32)
        self._ensure(c)
        if c.numel():
            if self.fe.preemph is not None:
                prev = c[:1] if self._prev is None else self._prev
                y = torch.cat([c[:1] if self._prev is None else c[:1] - self.fe.preemph * prev,
                               c[1:] - self.fe.preemph * c[:-1]])
            else:
                y = c
            self._prev = c[-1:]
            self._buf = torch.cat([self._buf, y])
            self._seen += c.numel()
        return self._windows(final=False)

    def _log_mel(self, windows: torch.Tensor) -> torch.Tensor:
        if windows.shape[0] == 0:
            return windows.new_zeros(0, self.fe.num_bins)
        return self.fe.log_mel_frames(windows)

    def _windows(self, final: bool) -> torch.Tensor:
        fe = self.fe
        assert self._buf is not None
        total_valid = fe.num_frames(self._seen) if final else None
        n_avail = 0
        if self._buf.shape[0] >= fe.n_fft:
            n_avail = (self._buf.shape[0] - fe.n_fft) // fe.hop_length + 1
        if final:
            need = total_valid - self._emitted
            if need > n_avail:
                pad = (need - 1) * fe.hop_length + fe.n_fft - self._buf.shape[0]
                self._buf = torch.nn.functional.pad(self._buf, (0, pad))
            n = max(need, 0)
        else:
            # A frame may only be emitted when it is certainly valid: its index < seen // hop.
            n = min(n_avail, fe.num_frames(self._seen) - self._emitted)
            n = max(n, 0)
        if n == 0:
            return self._buf.new_zeros(0, fe.n_fft)
        frames = self._buf.unfold(0, fe.n_fft, fe.hop_length)[:n]
        self._buf = self._buf[n * fe.hop_length :]
        self._emitted += n
        return frames

    def finish(self) -> torch.Tensor:
        return self._log_mel(self.finish_windows())

    def finish_windows(self) -> torch.Tensor:
        """:meth:`finish` before the log-mel (see :meth:`accept_windows`)."""
        if self._buf is None:
            dev = self.device or "cpu"
            return torch.zeros(0, self.fe.n_fft, device=dev)
        return self._windows(final=True)

"""Kaldi-compatible log mel filterbank (``compute-fbank-feats``), batched, in torch.

Matches Kaldi / kaldi-native-fbank / torchaudio.compliance.kaldi.fbank: per frame optional dither,
DC-offset removal, (raw) log energy, pre-emphasis ``x[i] -= c * x[i-1]`` (``x[0] -= c * x[0]``),
window (povey by default), zero-pad to a power of two, power spectrum, HTK-mel triangular banks
between ``low_freq`` and ``high_freq`` (``<= 0`` means offset from Nyquist), ``log(max(x, eps))``.
Frames are 25 ms / 10 ms by default; ``snip_edges=True`` keeps only whole frames inside the signal,
``False`` centres frames on multiples of the shift and reflects at the edges, as Kaldi does.

Spec mapping: ``FeatureSpec(kind="kaldi_fbank", sample_rate, num_bins, win_length, hop_length)``;
``options``: ``window_type`` (povey), ``preemph_coeff`` (0.97), ``remove_dc_offset`` (True),
``dither`` (0.0: inference), ``snip_edges`` (True), ``round_to_power_of_two`` (True),
``low_freq`` (20), ``high_freq`` (0), ``use_energy`` (False), ``raw_energy`` (True),
``energy_floor`` (0.0), ``htk_compat`` (False), ``use_log_fbank`` (True), ``use_power`` (True),
``blackman_coeff`` (0.42), ``scale`` (1.0; WeNet and FunASR feed 16-bit-scaled samples: 32768),
``frame_length_ms`` / ``frame_shift_ms`` (override win/hop). Unknown keys are ignored.

Output is time-major: (frames, bins) for a 1-D waveform, (B, frames, bins) plus frame lengths for
a batch (:meth:`KaldiFbank.extract`). Everything stays on the waveform's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from oasr.errors import InvalidRequestError, UnsupportedOptionError
from oasr.features._common import FLT_EPSILON, kaldi_mel_banks_np, kaldi_window, next_pow2
from oasr.features.batching import as_batch, mask_frames
from oasr.types import FeatureSpec


@dataclass(frozen=True)
class KaldiFbankOptions:
    sample_rate: float = 16000.0
    num_bins: int = 80
    win_length: int = 400
    hop_length: int = 160
    window_type: str = "povey"
    preemph_coeff: float = 0.97
    remove_dc_offset: bool = True
    dither: float = 0.0
    snip_edges: bool = True
    round_to_power_of_two: bool = True
    low_freq: float = 20.0
    high_freq: float = 0.0
    use_energy: bool = False
    raw_energy: bool = True
    energy_floor: float = 0.0
    htk_compat: bool = False
    use_log_fbank: bool = True
    use_power: bool = True
    blackman_coeff: float = 0.42
    scale: float = 1.0

    @property
    def n_fft(self) -> int:
        return next_pow2(self.win_length) if self.round_to_power_of_two else self.win_length

    @property
    def dim(self) -> int:
        return self.num_bins + (1 if self.use_energy else 0)

    @classmethod
    def from_spec(cls, spec: FeatureSpec, **overrides: Any) -> KaldiFbankOptions:
        o = {**spec.options, **overrides}
        sr = float(o.get("sample_rate", spec.sample_rate))
        win = int(spec.win_length)
        hop = int(spec.hop_length)
        if "frame_length_ms" in o:
            win = int(sr * 0.001 * float(o["frame_length_ms"]))
        if "frame_shift_ms" in o:
            hop = int(sr * 0.001 * float(o["frame_shift_ms"]))
        names = {f for f in cls.__dataclass_fields__} - {"sample_rate", "win_length", "hop_length"}
        kw = {k: o[k] for k in names if k in o}
        if "window" in o and "window_type" not in o:
            kw["window_type"] = o["window"]
        kw.setdefault("num_bins", int(o.get("num_mel_bins", spec.num_bins)))
        opts = cls(sample_rate=sr, win_length=win, hop_length=hop, **kw)
        opts.validate()
        return opts

    def validate(self) -> None:
        if self.win_length < 2 or self.hop_length < 1:
            raise InvalidRequestError(
                f"frame length {self.win_length} / shift {self.hop_length} samples are too small",
                param="win_length",
            )
        if self.num_bins < 3:
            raise InvalidRequestError("num_bins must be >= 3", param="num_bins")
        if self.dither < 0:
            raise InvalidRequestError("dither must be >= 0", param="dither")
        kaldi_mel_banks_np(
            self.num_bins, self.n_fft, self.sample_rate, self.low_freq, self.high_freq
        )
        kaldi_window(self.window_type, self.win_length)


def num_frames(num_samples: int, win: int, hop: int, snip_edges: bool = True) -> int:
    """Kaldi's frame count for a signal of ``num_samples`` samples."""
    if snip_edges:
        return 0 if num_samples < win else 1 + (num_samples - win) // hop
    return (num_samples + hop // 2) // hop


class KaldiFbank:
    """Registry entry for ``FeatureSpec(kind="kaldi_fbank")``. See the module docstring."""

    def __init__(self, spec: FeatureSpec | None = None, **overrides: Any) -> None:
        spec = spec or FeatureSpec(kind="kaldi_fbank")
        self.spec = spec
        self.opts = KaldiFbankOptions.from_spec(spec, **overrides)
        o = self.opts
        self._mel_np = kaldi_mel_banks_np(o.num_bins, o.n_fft, o.sample_rate, o.low_freq, o.high_freq)
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def dim(self) -> int:
        return self.opts.dim

    def num_frames(self, num_samples: int) -> int:
        o = self.opts
        return num_frames(num_samples, o.win_length, o.hop_length, o.snip_edges)

    def frame_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        o = self.opts
        if o.snip_edges:
            n = (lengths - o.win_length) // o.hop_length + 1
            return torch.where(lengths >= o.win_length, n, torch.zeros_like(n))
        return (lengths + o.hop_length // 2) // o.hop_length

    def _consts(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        c = self._cache.get(device)
        if c is None:
            o = self.opts
            win = kaldi_window(o.window_type, o.win_length, device, o.blackman_coeff)
            mel = torch.from_numpy(self._mel_np).to(device)
            c = self._cache[device] = (win, mel)
        return c

    # -- core: (..., F, W) raw frames -> (..., F, dim) features
    def compute_frames(self, frames: torch.Tensor) -> torch.Tensor:
        o = self.opts
        win, mel = self._consts(frames.device)
        x = frames.to(torch.float32)
        if x.shape[-2] == 0:  # no frames (some FFT backends reject empty batches)
            return x.new_zeros(*x.shape[:-1], o.dim)
        if o.dither > 0:
            x = x + o.dither * torch.randn_like(x)
        if o.remove_dc_offset:
            x = x - x.mean(dim=-1, keepdim=True)
        energy = None
        if o.use_energy and o.raw_energy:
            energy = x.pow(2).sum(-1)
        if o.preemph_coeff != 0.0:
            first = x[..., :1] * (1.0 - o.preemph_coeff)
            x = torch.cat([first, x[..., 1:] - o.preemph_coeff * x[..., :-1]], dim=-1)
        x = x * win
        if o.use_energy and not o.raw_energy:
            energy = x.pow(2).sum(-1)
        if o.n_fft > o.win_length:
            x = torch.nn.functional.pad(x, (0, o.n_fft - o.win_length))
        spec = torch.fft.rfft(x, n=o.n_fft)
        power = spec.real.pow(2) + spec.imag.pow(2)
        if not o.use_power:
            power = power.sqrt()
        feats = power @ mel
        if o.use_log_fbank:
            feats = feats.clamp_min(FLT_EPSILON).log()
        if energy is not None:
            log_e = energy.clamp_min(FLT_EPSILON).log()
            if o.energy_floor > 0.0:
                log_e = log_e.clamp_min(math.log(o.energy_floor))
            if o.htk_compat:
                feats = torch.cat([feats, log_e.unsqueeze(-1)], dim=-1)
            else:
                feats = torch.cat([log_e.unsqueeze(-1), feats], dim=-1)
        return feats

    def _frames(self, x: torch.Tensor, lens: torch.Tensor, n_frames: int) -> torch.Tensor:
        o = self.opts
        W, H = o.win_length, o.hop_length
        B, T = x.shape
        if n_frames == 0:
            return x.new_zeros(B, 0, W)
        if o.snip_edges:
            return x.unfold(-1, W, H)[:, :n_frames]
        # Centred frames with reflection at both ends of *each* item's true length.
        t = torch.arange(n_frames, device=x.device)
        start = t * H + H // 2 - W // 2
        idx = start[:, None] + torch.arange(W, device=x.device)[None, :]  # (F, W)
        idx = idx[None].expand(B, -1, -1)
        n = lens.clamp_min(1)[:, None, None]
        idx = torch.where(idx < 0, -idx - 1, idx)
        idx = torch.where(idx >= n, 2 * n - 1 - idx, idx)
        idx = idx.clamp(min=0).minimum(n - 1).clamp(max=T - 1)
        return torch.gather(x[:, None, :].expand(B, n_frames, T), 2, idx)

    def extract(
        self, audio: torch.Tensor | np.ndarray | list, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch of waveforms (B, T) + lengths -> ((B, F, dim) features zero-padded, (B,) frames)."""
        x, lens, _ = as_batch(audio, lengths)
        if self.opts.scale != 1.0:
            x = x * self.opts.scale
        flens = self.frame_lengths(lens)
        n_frames = self.num_frames(x.shape[1])
        feats = self.compute_frames(self._frames(x, lens, n_frames))
        if lengths is not None or feats.shape[0] > 1:  # (no host sync to decide this)
            feats = mask_frames(feats, flens)
        return feats, flens

    def __call__(
        self, audio: torch.Tensor | np.ndarray, lengths: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(T,) -> (frames, dim); (B, T) -> (B, frames, dim) (frames past a length are zero)."""
        x = torch.as_tensor(audio)
        feats, _ = self.extract(x, lengths)
        return feats[0] if x.dim() == 1 else feats

    def stream(self, device: torch.device | str | None = None) -> KaldiFbankStream:
        return KaldiFbankStream(self, device)


class KaldiFbankStream:
    """Streaming framing for :class:`KaldiFbank` (``snip_edges=True``).

    ``accept(chunk)`` takes any number of samples (even 1) and returns the (n, dim) frames that
    became complete; the concatenation over all calls equals ``fbank(whole_signal)``.
    """

    def __init__(self, fbank: KaldiFbank, device: torch.device | str | None = None) -> None:
        if not fbank.opts.snip_edges:
            raise UnsupportedOptionError(
                "streaming kaldi fbank needs snip_edges=True (centred frames depend on the total "
                "length); set options['snip_edges'] = True",
                param="snip_edges",
            )
        self.fbank = fbank
        self.device = None if device is None else torch.device(device)
        self._buf: torch.Tensor | None = None
        self.frames_emitted = 0

    def accept(self, chunk: torch.Tensor | np.ndarray) -> torch.Tensor:
        o = self.fbank.opts
        c = torch.as_tensor(chunk)
        if self.device is not None:
            c = c.to(self.device)
        c = c.reshape(-1).to(torch.float32)
        if o.scale != 1.0:
            c = c * o.scale
        buf = c if self._buf is None else torch.cat([self._buf, c])
        n = num_frames(buf.shape[0], o.win_length, o.hop_length, True)
        if n == 0:
            self._buf = buf
            return buf.new_zeros(0, o.dim)
        feats = self.fbank.compute_frames(buf.unfold(0, o.win_length, o.hop_length)[:n])
        self._buf = buf[n * o.hop_length :]
        self.frames_emitted += n
        return feats

    def finish(self) -> torch.Tensor:
        """No further frames exist with ``snip_edges=True``; returns an empty (0, dim) tensor."""
        dev = self.device or (self._buf.device if self._buf is not None else "cpu")
        self._buf = None
        return torch.zeros(0, self.fbank.opts.dim, device=dev)

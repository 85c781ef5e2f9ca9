"""FunASR's ``WavFrontend``: Kaldi fbank + low-frame-rate (LFR) stacking + CMVN (Paraformer).

Semantics follow funasr/frontends/wav_frontend.py:

* waveform scaled by 32768 (``upsacle_samples``), Kaldi fbank with a **hamming** window,
  ``energy_floor=0``, 25 ms / 10 ms, ``snip_edges=True`` (all overridable through ``options``);
  dither defaults to 0 here (inference); set ``options["dither"]`` to reproduce training noise.
* LFR: output frame ``i`` concatenates fbank frames ``i*lfr_n - (lfr_m-1)//2 ... + lfr_m - 1``
  where indices before 0 replicate the first frame and indices past the end replicate the last,
  giving ``ceil(T / lfr_n)`` frames of ``lfr_m * num_bins`` values.
* CMVN from an ``am.mvn`` file in Kaldi nnet1 text format (``<AddShift>`` then ``<Rescale>``, each
  followed by a ``<LearnRateCoef> 0 [ ... ]`` line): ``(x + shift) * rescale``.

Options: ``lfr_m`` (7), ``lfr_n`` (6), ``cmvn_file`` (path or None), ``upscale`` (True), plus every
:mod:`oasr.features.kaldi` option. Output is time-major (B, T_lfr, lfr_m * num_bins).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
import torch

from oasr.errors import CheckpointError, InvalidRequestError
from oasr.features.batching import as_batch, mask_frames
from oasr.features.kaldi import KaldiFbank, KaldiFbankStream
from oasr.types import FeatureSpec


def load_am_mvn(path: str | os.PathLike) -> np.ndarray:
    """Parse FunASR's ``am.mvn`` (Kaldi nnet1 text) -> (2, dim) float32 [shift; rescale]."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read CMVN file {os.fspath(path)!r}: {e}") from None
    return parse_am_mvn(text, name=os.fspath(path))


def parse_am_mvn(text: str, name: str = "am.mvn") -> np.ndarray:
    lines = text.splitlines()
    found: dict[str, np.ndarray] = {}
    for i, line in enumerate(lines):
        toks = line.split()
        if not toks or toks[0] not in ("<AddShift>", "<Rescale>"):
            continue
        if i + 1 >= len(lines):
            break
        nxt = lines[i + 1].split()
        if not nxt or nxt[0] != "<LearnRateCoef>" or "[" not in nxt or "]" not in nxt:
            continue
        a, b = nxt.index("["), nxt.index("]")
        try:
            found[toks[0]] = np.asarray([float(v) for v in nxt[a + 1 : b]], dtype=np.float32)
        except ValueError:
            raise CheckpointError(f"{name}: non-numeric values in the {toks[0]} block") from None
    if "<AddShift>" not in found or "<Rescale>" not in found:
        raise CheckpointError(
            f"{name} is not a FunASR am.mvn file: it needs <AddShift> and <Rescale> blocks, each "
            f"followed by a '<LearnRateCoef> 0 [ ... ]' line"
        )
    shift, rescale = found["<AddShift>"], found["<Rescale>"]
    if shift.shape != rescale.shape or shift.size == 0:
        raise CheckpointError(
            f"{name}: <AddShift> has {shift.size} values but <Rescale> has {rescale.size}"
        )
    return np.stack([shift, rescale])


def lfr_indices(n_frames: torch.Tensor, n_out: int, lfr_m: int, lfr_n: int) -> torch.Tensor:
    """(B,) fbank frame counts -> (B, n_out, lfr_m) source frame indices (edge-replicated)."""
    dev = n_frames.device
    left = (lfr_m - 1) // 2
    pos = (
        torch.arange(n_out, device=dev)[:, None] * lfr_n
        + torch.arange(lfr_m, device=dev)[None, :]
        - left
    )
    hi = (n_frames - 1).clamp_min(0)[:, None, None]
    return pos[None].clamp(min=0).minimum(hi)


class FunASRFbankLFR:
    """Registry entry for ``FeatureSpec(kind="funasr_fbank_lfr")``."""

    def __init__(self, spec: FeatureSpec | None = None, *, cmvn: np.ndarray | None = None) -> None:
        spec = spec or FeatureSpec(kind="funasr_fbank_lfr")
        self.spec = spec
        o = dict(spec.options)
        self.lfr_m = int(o.pop("lfr_m", 7))
        self.lfr_n = int(o.pop("lfr_n", 6))
        if self.lfr_m < 1 or self.lfr_n < 1:
            raise InvalidRequestError("lfr_m and lfr_n must be >= 1", param="lfr_m")
        upscale = bool(o.pop("upscale", o.pop("upsacle_samples", True)))
        cmvn_file = o.pop("cmvn_file", None)
        o.setdefault("window_type", o.pop("window", "hamming"))
        o.setdefault("energy_floor", 0.0)
        o.setdefault("dither", 0.0)
        o.setdefault("scale", 32768.0 if upscale else 1.0)
        fspec = FeatureSpec(
            kind="kaldi_fbank",
            sample_rate=spec.sample_rate,
            num_bins=spec.num_bins,
            hop_length=spec.hop_length,
            win_length=spec.win_length,
            n_fft=spec.n_fft,
            options=o,
        )
        self.fbank = KaldiFbank(fspec)
        if cmvn is None and cmvn_file is not None:
            cmvn = load_am_mvn(cmvn_file)
        self.cmvn_np = None if cmvn is None else np.asarray(cmvn, dtype=np.float32)
        if self.cmvn_np is not None and self.cmvn_np.shape[-1] < self.dim:
            raise CheckpointError(
                f"CMVN has {self.cmvn_np.shape[-1]} dims but features have {self.dim} "
                f"(num_bins {self.fbank.opts.num_bins} x lfr_m {self.lfr_m}); the am.mvn does not "
                f"belong to this frontend configuration"
            )
        self._cmvn_cache: dict[torch.device, torch.Tensor] = {}

    @property
    def dim(self) -> int:
        return self.fbank.dim * self.lfr_m

    def _cmvn(self, device: torch.device) -> torch.Tensor | None:
        if self.cmvn_np is None:
            return None
        c = self._cmvn_cache.get(device)
        if c is None:
            c = self._cmvn_cache[device] = torch.from_numpy(self.cmvn_np[:, : self.dim]).to(device)
        return c

    def num_frames(self, num_samples: int) -> int:
        return math.ceil(self.fbank.num_frames(num_samples) / self.lfr_n)

    def apply_cmvn(self, feats: torch.Tensor) -> torch.Tensor:
        c = self._cmvn(feats.device)
        if c is None:
            return feats
        return (feats + c[0]) * c[1]

    def lfr(self, fb: torch.Tensor, fb_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, D) fbank + lengths -> (B, ceil(T/n), m*D) stacked frames + lengths."""
        B, T, D = fb.shape
        out_lens = torch.div(fb_lens + self.lfr_n - 1, self.lfr_n, rounding_mode="floor")
        n_out = math.ceil(T / self.lfr_n)
        if n_out == 0:
            return fb.new_zeros(B, 0, D * self.lfr_m), out_lens
        idx = lfr_indices(fb_lens, n_out, self.lfr_m, self.lfr_n)  # (B, n_out, m)
        g = torch.gather(fb, 1, idx.reshape(B, -1, 1).expand(-1, -1, D))
        return g.reshape(B, n_out, self.lfr_m * D), out_lens

    def extract(
        self, audio: torch.Tensor | np.ndarray | list, lengths: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, lens, _ = as_batch(audio, lengths)
        fb, fb_lens = self.fbank.extract(x, lens)
        feats, out_lens = self.lfr(fb, fb_lens)
        feats = self.apply_cmvn(feats)
        return mask_frames(feats, out_lens), out_lens

    def __call__(self, audio: Any, lengths: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.as_tensor(audio)
        feats, _ = self.extract(x, lengths)
        return feats[0] if x.dim() == 1 else feats

    def stream(self, device: torch.device | str | None = None) -> FunASRStream:
        return FunASRStream(self, device)


class FunASRStream:
    """Streaming fbank + LFR + CMVN whose concatenated output equals the offline features.

    An LFR frame is emitted once all ``lfr_m`` fbank frames it stacks exist; :meth:`finish`
    emits the tail frames, which replicate the last fbank frame as FunASR's offline frontend does.
    """

    def __init__(self, fe: FunASRFbankLFR, device: torch.device | str | None = None) -> None:
        self.fe = fe
        self._fb = KaldiFbankStream(fe.fbank, device)
        self._frames: torch.Tensor | None = None  # fbank frames from index self._base on
        self._base = 0  # fbank index of self._frames[0]
        self._total = 0  # fbank frames seen so far
        self._first: torch.Tensor | None = None
        self._next = 0  # next LFR output index

    def _emit(self, final: bool) -> torch.Tensor:
        m, n = self.fe.lfr_m, self.fe.lfr_n
        left = (m - 1) // 2
        D = self.fe.fbank.dim
        if self._frames is None:
            dev = self._fb.device or "cpu"
            return torch.zeros(0, D * m, device=dev)
        T = self._total
        if final:
            last = math.ceil(T / n)  # outputs 0 .. last-1
        else:
            # output i needs fbank index i*n - left + m - 1 < T
            last = max(0, (T - m + left) // n + 1) if T - m + left >= 0 else 0
            last = min(last, math.ceil(T / n))
        count = last - self._next
        if count <= 0:
            return self._frames.new_zeros(0, D * m)
        pos = (
            torch.arange(self._next, last, device=self._frames.device)[:, None] * n
            + torch.arange(m, device=self._frames.device)[None, :]
            - left
        ).clamp(0, T - 1) - self._base
        out = self._frames[pos.reshape(-1)].reshape(count, m * D)
        self._next = last
        # drop fbank frames no future output needs
        keep_from = max(0, self._next * n - left)
        drop = min(keep_from - self._base, self._frames.shape[0] - 1)
        if drop > 0:
            self._frames = self._frames[drop:]
            self._base += drop
        return self.fe.apply_cmvn(out)

    def accept(self, chunk: torch.Tensor | np.ndarray) -> torch.Tensor:
        new = self._fb.accept(chunk)
        if new.shape[0]:
            self._frames = new if self._frames is None else torch.cat([self._frames, new])
            self._total += new.shape[0]
        return self._emit(final=False)

    def finish(self) -> torch.Tensor:
        self._fb.finish()
        return self._emit(final=True)

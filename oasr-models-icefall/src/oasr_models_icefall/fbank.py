"""Streaming framing of Kaldi fbank with ``snip_edges=False`` (what icefall uses).

Frame ``t`` covers samples ``[hop t + hop/2 - win/2, ... + win)`` (reflected at the start): it is
final once those samples arrived, since only the last frames of a signal reflect at its end. So a
stream emits every complete frame as audio comes in and, at ``finish()``, the rest with the end
reflection; the frames equal :meth:`oasr.features.kaldi.KaldiFbank.extract` on the whole signal.
The feature computation is core's (``KaldiFbank.compute_frames``); only the framing is here
(core's own stream supports ``snip_edges=True`` only).
"""

from __future__ import annotations

import numpy as np
import torch

from oasr.features.kaldi import KaldiFbank


class CenteredFbankStream:
    """The framing of one stream, on the host in numpy (a stream step frames hundreds of
    streams: numpy's per-call cost is a fraction of torch's on such small arrays)."""

    def __init__(self, fbank: KaldiFbank) -> None:
        o = fbank.opts
        self.fbank = fbank
        self.win, self.hop = o.win_length, o.hop_length
        self.scale = o.scale
        self.lead = self.win // 2 - self.hop // 2  # samples a frame reaches before its hop start
        self.buffer = np.zeros(0, np.float32)
        self.buffer_start = 0  # absolute index of buffer[0]
        self.received = 0
        self.emitted = 0  # frames returned so far
        self._offsets = np.arange(self.win)

    def samples_for(self, frames: int) -> int:
        """Samples needed before ``frames`` frames are complete."""
        return 0 if frames <= 0 else (frames - 1) * self.hop - self.lead + self.win

    def _raw(self, first: int, last: int, total: int | None) -> np.ndarray:
        """Samples of frames ``first .. last - 1``, (n, win) float32, scaled."""
        idx = (np.arange(first, last) * self.hop - self.lead)[:, None] + self._offsets[None, :]
        if first * self.hop < self.lead:  # the first frames reflect at the start
            idx = np.where(idx < 0, -idx - 1, idx)
        if total is not None:
            idx = np.where(idx >= total, 2 * total - 1 - idx, idx).clip(0, total - 1)
        frames = self.buffer[idx - self.buffer_start]
        return frames * np.float32(self.scale) if self.scale != 1.0 else frames

    def _trim(self) -> None:
        keep_from = max(0, self.emitted * self.hop - self.lead)
        if self.emitted == 0:
            keep_from = 0
        if keep_from > self.buffer_start:
            self.buffer = self.buffer[keep_from - self.buffer_start :]
            self.buffer_start = keep_from

    def accept_raw(self, chunk: np.ndarray | torch.Tensor) -> np.ndarray:
        """New samples -> the raw windows of the frames they complete, (n, win) float32: several
        streams' windows go through ``KaldiFbank.compute_frames`` in one call."""
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        self.buffer = np.concatenate([self.buffer, chunk]) if self.buffer.size else chunk
        self.received += chunk.size
        ready = 0
        if self.received >= self.win - self.lead:
            ready = (self.received + self.lead - self.win) // self.hop + 1
        if ready <= self.emitted:
            return np.zeros((0, self.win), np.float32)
        out = self._raw(self.emitted, ready, None)
        self.emitted = ready
        self._trim()
        return out

    def finish_raw(self) -> np.ndarray:
        """Raw windows of the last frames (reflected at the end of the signal)."""
        total = self.fbank.num_frames(self.received)
        if total <= self.emitted or self.received == 0:
            return np.zeros((0, self.win), np.float32)
        out = self._raw(self.emitted, total, self.received)
        self.emitted = total
        return out

    def accept(self, chunk: np.ndarray | torch.Tensor) -> torch.Tensor:
        """New samples -> the frames they complete, (n, dim)."""
        return self.fbank.compute_frames(torch.from_numpy(self.accept_raw(chunk)))

    def finish(self) -> torch.Tensor:
        """The last frames (reflected at the end of the signal)."""
        return self.fbank.compute_frames(torch.from_numpy(self.finish_raw()))

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
    """The framing of one stream, on the host in numpy: the stream keeps its samples, counts the
    frames they complete, and writes the samples that a run of complete frames covers straight
    into a step's batch buffer (one contiguous copy per stream and step away from the signal's
    ends); the device cuts the frames out of it (``unfold``)."""

    def __init__(self, fbank: KaldiFbank) -> None:
        o = fbank.opts
        self.fbank = fbank
        self.win, self.hop = o.win_length, o.hop_length
        self.scale = o.scale
        self.lead = self.win // 2 - self.hop // 2  # samples a frame reaches before its hop start
        self.buffer = np.zeros(0, np.float32)
        self.buffer_start = 0  # absolute index of buffer[0]
        self.received = 0
        self.emitted = 0  # frames complete so far (all of them once finished)
        self.finished = False

    def samples_for(self, frames: int) -> int:
        """Samples needed before ``frames`` frames are complete."""
        return 0 if frames <= 0 else (frames - 1) * self.hop - self.lead + self.win

    def accept(self, chunk: np.ndarray | torch.Tensor) -> int:
        """New samples; returns how many frames are complete now."""
        chunk = np.asarray(chunk, dtype=np.float32).reshape(-1)
        if chunk.size:
            self.buffer = np.concatenate([self.buffer, chunk]) if self.buffer.size else chunk
            self.received += chunk.size
        if self.received >= self.win - self.lead:
            self.emitted = max(self.emitted, (self.received + self.lead - self.win) // self.hop + 1)
        return self.emitted

    def finish(self) -> int:
        """End of the signal: its last frames (reflected at the end) are complete too."""
        self.finished = True
        if self.received:
            self.emitted = max(self.emitted, self.fbank.num_frames(self.received))
        return self.emitted

    def span(self, n: int) -> int:
        """Samples that ``n`` consecutive frames cover."""
        return (n - 1) * self.hop + self.win if n > 0 else 0

    def write_span(self, out: np.ndarray, first: int, n: int) -> None:
        """The samples that frames ``first .. first + n - 1`` (complete ones) cover, scaled, into
        ``out[:span(n)]``: the frames are its windows every ``hop`` samples (``unfold``). Away
        from the signal's ends this is one contiguous copy; the first frames read the signal
        reflected at its start, the last ones (after :meth:`finish`) reflected at its end, and
        the reflected samples are written out, so the windows stay evenly spaced."""
        if n <= 0:
            return
        start = first * self.hop - self.lead
        end = start + self.span(n)
        if start >= 0 and end <= self.received:
            out[: end - start] = self.buffer[start - self.buffer_start : end - self.buffer_start]
        else:
            idx = np.arange(start, end)
            idx = np.where(idx < 0, -idx - 1, idx)
            total = self.received
            idx = np.where(idx >= total, 2 * total - 1 - idx, idx).clip(0, max(total - 1, 0))
            out[: end - start] = self.buffer[idx - self.buffer_start]
        if self.scale != 1.0:
            out[: end - start] *= np.float32(self.scale)

    def drop_before(self, frame: int) -> None:
        """Frames before ``frame`` will not be read again: free their samples."""
        keep_from = max(0, frame * self.hop - self.lead)
        if keep_from > self.buffer_start:
            self.buffer = self.buffer[keep_from - self.buffer_start :]
            self.buffer_start = keep_from

    def frames(self, first: int = 0, n: int | None = None) -> torch.Tensor:
        """Fbank features of complete frames ``first .. first + n - 1`` (default: all from
        ``first``), (n, dim); for checks (a stream step computes them on the model's device)."""
        n = max(self.emitted - first if n is None else n, 0)
        samples = np.zeros(max(self.span(n), self.win), np.float32)
        self.write_span(samples, first, n)
        return self.fbank.compute_frames(torch.from_numpy(samples).unfold(0, self.win, self.hop)[:n])

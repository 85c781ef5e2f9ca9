"""The Silero VAD network (v5/v6 shape) written on ``oasr.layers``.

One sub-model per sample rate. Each window of ``window`` new samples is scored together with the
``context`` samples that preceded it (zeros before the start of a stream):

    frame (context + window) -> reflect-pad right by n_fft/4 -> STFT magnitude as a strided
    Conv1d with a fixed Fourier basis (n_fft/2 + 1 bins, hop n_fft/2) -> 4 Conv1d + ReLU blocks
    (strides 1, 2, 2, 1; 128 -> 64 -> 64 -> 128 channels) -> one 128-d vector per window
    -> LSTM cell (128) carried across windows -> ReLU -> 1x1 Conv1d -> sigmoid = P(speech)

| rate | window | context | n_fft | hop | pad |
|---|---|---|---|---|---|
| 16 kHz | 512 | 64 | 256 | 128 | 64 |
| 8 kHz | 256 | 32 | 128 | 64 | 32 |

Everything before the LSTM depends on one frame only, so the encoder runs on all windows of all
streams as one batch; only the small LSTM step is sequential.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers import Conv1d
from oasr.layers.recurrent import LSTMCell

HIDDEN = 128
#: windows encoded per call in ``forward`` (memory bound for long inputs)
ENCODE_BLOCK = 16384


@dataclass(frozen=True)
class RateConfig:
    sample_rate: int
    window: int
    context: int
    n_fft: int

    @property
    def hop(self) -> int:
        return self.n_fft // 2

    @property
    def pad(self) -> int:
        return self.n_fft // 4

    @property
    def bins(self) -> int:
        return self.n_fft // 2 + 1

    @property
    def frame(self) -> int:
        return self.context + self.window


RATES: dict[int, RateConfig] = {
    16000: RateConfig(16000, window=512, context=64, n_fft=256),
    8000: RateConfig(8000, window=256, context=32, n_fft=128),
}


class SileroVADNet(nn.Module):
    """The network for one sample rate.

    ``forward(frames, h, c, mask)``: ``frames`` ``(B, N, context + window)`` -> probabilities
    ``(B, N)`` and the LSTM state after the last valid window of each row.
    """

    def __init__(self, cfg: RateConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Fourier basis: real rows then imaginary rows, kernel n_fft, stride hop, no bias.
        self.stft = Conv1d(1, 2 * cfg.bins, cfg.n_fft, stride=cfg.hop, bias=False)
        chans = [(cfg.bins, 128, 1), (128, 64, 2), (64, 64, 2), (64, HIDDEN, 1)]
        self.encoder = nn.ModuleList(
            Conv1d(i, o, 3, stride=s, padding=1) for i, o, s in chans
        )
        self.lstm = LSTMCell(HIDDEN, HIDDEN)
        self.head = Conv1d(HIDDEN, 1, 1)

    def encode(self, frames: torch.Tensor) -> torch.Tensor:
        """``(M, context + window)`` -> ``(M, 128)`` per-window features."""
        cfg = self.cfg
        x = F.pad(frames.unsqueeze(1), (0, cfg.pad), mode="reflect")
        spec = self.stft(x)
        real, imag = spec[:, : cfg.bins], spec[:, cfg.bins :]
        x = torch.sqrt(real * real + imag * imag)
        for conv in self.encoder:
            x = torch.relu(conv(x))
        # the encoder reduces the 4 STFT frames to 1 (strides 2, 2); average is a no-op then
        return x.mean(dim=-1)

    def decode(self, hidden: torch.Tensor) -> torch.Tensor:
        """LSTM outputs ``(B, N, 128)`` -> probabilities ``(B, N)``."""
        b, n, _ = hidden.shape
        x = torch.relu(hidden.reshape(b * n, HIDDEN, 1))
        return torch.sigmoid(self.head(x)).reshape(b, n)

    def forward(
        self,
        frames: torch.Tensor,
        h: torch.Tensor | None = None,
        c: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, length = frames.shape
        if length != self.cfg.frame:
            raise ValueError(f"frames must hold {self.cfg.frame} samples, got {length}")
        if n == 0:
            if h is None or c is None:
                h, c = self.lstm.zero_state(b, frames)
            return frames.new_zeros(b, 0), h, c
        with _full_precision(frames):
            flat = frames.reshape(b * n, length)
            # the encoder's activations are ~4 kB per window: bound them for long inputs
            feats = torch.cat(
                [self.encode(flat[i : i + ENCODE_BLOCK]) for i in range(0, b * n, ENCODE_BLOCK)]
            ).reshape(b, n, HIDDEN)
            hidden, h, c = self.lstm.forward_sequence(feats, h, c, mask)
            return self.decode(hidden), h, c


def _full_precision(x: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """No TF32 on CUDA: cuDNN convolutions default to TF32, which moves probabilities by up to
    ~7e-4 (the 256-tap STFT convolution); in fp32 CUDA matches CPU to ~1e-6."""
    if x.device.type == "cuda" and x.dtype == torch.float32:
        return torch.backends.cudnn.flags(
            enabled=torch.backends.cudnn.enabled,
            benchmark=torch.backends.cudnn.benchmark,
            deterministic=torch.backends.cudnn.deterministic,
            allow_tf32=False,
        )
    return contextlib.nullcontext()


def frames_from_audio(
    audio: torch.Tensor, cfg: RateConfig, context: torch.Tensor | None = None
) -> torch.Tensor:
    """Cut ``audio`` ``(B, T)`` (``T`` a multiple of ``window``) into ``(B, T/window, frame)``
    frames, each window preceded by its ``context`` samples (``context`` ``(B, ctx)`` carries
    them in from a previous call; zeros at the start of a stream)."""
    b = audio.shape[0]
    if context is None:
        context = audio.new_zeros(b, cfg.context)
    x = torch.cat([context, audio], dim=1)
    return x.unfold(1, cfg.frame, cfg.window)

"""The contract between Whisper's network (``nn.py``) and its decoding (``decoding.py``).

Decoding never touches weights or layers; it drives any object with this interface. Keeping the
seam explicit lets the decoder logic be tested against a reference network too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class WhisperDims:
    n_mels: int
    n_audio_ctx: int  # 1500 for every released size
    n_audio_state: int
    n_audio_head: int
    n_audio_layer: int
    n_vocab: int
    n_text_ctx: int  # 448
    n_text_state: int
    n_text_head: int
    n_text_layer: int


class DecoderCache(Protocol):
    """Self-attention K/V per layer plus the cross-attention K/V computed once per input."""

    def reorder(self, index: torch.Tensor) -> None:
        """Keep/duplicate batch rows (beam search) in place: row i becomes old row index[i]."""
        ...

    @property
    def length(self) -> int:
        """Number of token positions already cached."""
        ...


class WhisperNetwork(Protocol):
    dims: WhisperDims
    #: (N, 2) long tensor of (decoder layer, head) pairs used for word alignment
    alignment_heads: torch.Tensor
    device: torch.device
    dtype: torch.dtype

    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) log-mel -> (B, n_audio_ctx, n_audio_state) audio features."""
        ...

    def new_cache(self, audio_features: torch.Tensor) -> DecoderCache:
        """A cache holding the cross-attention K/V of ``audio_features`` and no tokens yet."""
        ...

    def decode(self, tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Run the decoder on the ``tokens`` (B, T) that follow the cached positions, append them
        to the cache, and return logits (B, T, n_vocab) in float32."""
        ...

    def cross_attention(self, tokens: torch.Tensor, audio_features: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass over full ``tokens`` (B, T) returning the cross-attention weights
        of the alignment heads, shape (B, n_alignment_heads, T, n_audio_ctx), softmaxed."""
        ...

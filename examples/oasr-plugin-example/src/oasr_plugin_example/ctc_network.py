"""The ``example_ctc`` network, built only from ``oasr.layers``.

fbank (B, T, F) -> global mean/variance normalisation -> ``Conv2dSubsampling`` (x4, 40 ms
frames) -> ``num_layers`` blocks of [relative-position self-attention, causal Conformer
convolution, feed-forward], each pre-norm with a residual -> ``LayerNorm`` -> ``Linear`` to the
units -> log-softmax (CTC).

Streaming equals offline because every piece only looks left, or within a chunk:

* the subsampling convolutions have no time padding: ``(c - 1) * 4 + 7`` feature frames give
  exactly ``c`` encoder frames, and windows ``4 * c`` frames apart tile the offline output;
* attention uses a *chunk mask* offline (a frame sees its own chunk of ``chunk_size`` frames and
  ``num_left_chunks`` chunks before it); a stream keeps those keys in a per-layer K/V cache;
* the relative-position attention of ``oasr.layers`` gives each key a term that depends only on
  its absolute position (no rel-shift), so cached keys keep their meaning;
* the depthwise convolution is causal; a stream carries its last ``kernel - 1`` inputs.

:meth:`ExampleCTCNet.forward` runs whole utterances; :meth:`ExampleCTCNet.forward_chunk` runs
one chunk of each of several streams in one batch (rows padded and masked).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from oasr.layers import (
    ConformerConvModule,
    Conv2dSubsampling,
    LayerNorm,
    Linear,
    PositionwiseFeedForward,
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
)
from oasr_plugin_example.ctc_checkpoint import CTCConfig


def chunk_mask(length: int, chunk_size: int, num_left_chunks: int, device: torch.device | None = None) -> torch.Tensor:
    """(length, length) bool, True = query row may attend key column: keys in the query's own
    chunk and in the ``num_left_chunks`` chunks before it (all before it when -1)."""
    chunk = torch.arange(length, device=device) // chunk_size
    q, k = chunk[:, None], chunk[None, :]
    mask = k <= q
    if num_left_chunks >= 0:
        mask &= k >= q - num_left_chunks
    return mask


@dataclass
class LayerCache:
    """One layer's streaming cache for a batch of rows: attention keys/values (B, H, Tc, D),
    valid for each row's first ``lengths[b]`` positions, and the causal convolution's last inputs
    (B, C, kernel - 1)."""

    k: torch.Tensor
    v: torch.Tensor
    conv: torch.Tensor


class Block(nn.Module):
    def __init__(self, config: CTCConfig) -> None:
        super().__init__()
        d = config.d_model
        self.norm_attn = LayerNorm(d)
        self.attn = RelPositionMultiHeadAttention(d, config.num_heads)
        self.norm_conv = LayerNorm(d)
        self.conv = ConformerConvModule(d, config.conv_kernel, causal=True, norm="layer_norm")
        self.norm_ff = LayerNorm(d)
        self.ff = PositionwiseFeedForward(d, config.ffn_dim)

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        mask: torch.Tensor,
        valid: torch.Tensor,
        lengths: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None,
        conv_cache: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        a, kv = self.attn(self.norm_attn(x), pos_emb, mask, kv_cache)
        x = x + a
        c, conv_cache = self.conv(self.norm_conv(x), valid, conv_cache, lengths)
        x = x + c
        x = x + self.ff(self.norm_ff(x))
        return x, kv, conv_cache


class ExampleCTCNet(nn.Module):
    """See the module docstring. Parameters: ``cmvn_mean`` / ``cmvn_istd`` (buffers),
    ``subsampling.*``, ``blocks.{i}.*``, ``norm_out.*``, ``ctc.*``."""

    def __init__(self, config: CTCConfig) -> None:
        super().__init__()
        self.config = config
        self.register_buffer("cmvn_mean", torch.zeros(config.num_mel_bins))
        self.register_buffer("cmvn_istd", torch.ones(config.num_mel_bins))
        self.subsampling = Conv2dSubsampling(config.num_mel_bins, config.d_model, rate=4)
        self.pos = RelPositionalEncoding(config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm_out = LayerNorm(config.d_model)
        self.ctc = Linear(config.d_model, config.vocab_size)

    @property
    def subsampling_rate(self) -> int:
        return self.subsampling.rate

    @property
    def right_context(self) -> int:
        """Feature frames past the first that one encoder frame needs (6 at x4)."""
        return self.subsampling.right_context

    def _embed(self, feats: torch.Tensor, flens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.subsampling((feats - self.cmvn_mean) * self.cmvn_istd)
        x = self.pos.scale(x)
        lens = self.subsampling.output_length(flens).to(x.device)
        valid = torch.arange(x.shape[1], device=x.device)[None, :] < lens[:, None]
        return x, lens, valid

    def _log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.ctc(self.norm_out(x)).float(), dim=-1)

    def encode(self, feats: torch.Tensor, flens: torch.Tensor, chunk_size: int,
               num_left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole utterances: fbank (B, T, F) and frame lengths (B,) -> the last block's output
        (B, T', d) and encoder lengths (B,)."""
        x, lens, valid = self._embed(feats, flens)
        t = x.shape[1]
        mask = chunk_mask(t, chunk_size, num_left_chunks, x.device)[None] & valid[:, None, :]
        pos_emb = self.pos.range(0, t).to(x.dtype)
        for block in self.blocks:
            x, _, _ = block(x, pos_emb, mask, valid, lens)
        return x, lens

    def forward(self, feats: torch.Tensor, flens: torch.Tensor, chunk_size: int,
                num_left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole utterances -> CTC log-probabilities (B, T', V) in float32 and lengths (B,)."""
        x, lens = self.encode(feats, flens, chunk_size, num_left_chunks)
        return self._log_probs(x), lens

    def forward_chunk(self, feats: torch.Tensor, flens: torch.Tensor, offsets: torch.Tensor,
                      caches: list[LayerCache], cache_lengths: torch.Tensor,
                      ) -> tuple[torch.Tensor, torch.Tensor, list[LayerCache]]:
        """One chunk of each stream: fbank windows (B, W, F) with frame lengths (B,); ``offsets``
        (B,) encoder frames each stream has already produced; per-layer ``caches`` whose keys
        are valid for each row's first ``cache_lengths`` positions (the stream's last keys,
        positions ``offset - cache_length .. offset - 1``). Returns log-probabilities (B, t, V),
        the frames each row produced (B,), and the caches extended by this chunk's keys (same
        layout: cached keys first, this chunk's at ``Tc ..``)."""
        x, lens, valid = self._embed(feats, flens)
        b, t = x.shape[:2]
        dev = x.device
        tc = caches[0].k.shape[2] if caches else 0
        cached = torch.arange(tc, device=dev)[None, :] < cache_lengths[:, None]
        # within one chunk every frame sees every earlier key and all frames of the chunk
        key_valid = torch.cat([cached, valid], dim=1)  # (B, Tc + t)
        mask = key_valid[:, None, :].expand(b, t, tc + t)
        positions = torch.cat([
            offsets[:, None] - cache_lengths[:, None] + torch.arange(tc, device=dev)[None, :],
            offsets[:, None] + torch.arange(t, device=dev)[None, :],
        ], dim=1)  # fmt: skip
        pos_emb = self.pos.gather(positions).to(x.dtype)
        new: list[LayerCache] = []
        for block, cache in zip(self.blocks, caches, strict=True):
            x, (k, v), conv = block(x, pos_emb, mask, valid, lens, (cache.k, cache.v), cache.conv)
            new.append(LayerCache(k, v, conv))
        return self._log_probs(x), lens, new

    def empty_caches(self, batch: int, cache_frames: int) -> list[LayerCache]:
        """Zero caches for ``batch`` rows with room for ``cache_frames`` keys."""
        c = self.config
        p = self.ctc.weight
        heads, d_k = c.num_heads, c.d_model // c.num_heads
        return [
            LayerCache(
                p.new_zeros(batch, heads, cache_frames, d_k),
                p.new_zeros(batch, heads, cache_frames, d_k),
                p.new_zeros(batch, c.d_model, c.conv_kernel - 1),
            )
            for _ in self.blocks
        ]

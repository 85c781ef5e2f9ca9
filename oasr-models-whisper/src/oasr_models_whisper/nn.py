"""Whisper's network on ``oasr.layers``; implements :class:`~oasr_models_whisper.network.WhisperNetwork`.

Entry points used by the rest of the plugin::

    build_network(loaded: LoadedWhisper, device="cpu", dtype=None) -> WhisperNet
    WhisperNet(dims, alignment_heads=None, device=None, dtype=None)
    net.encode(mel) / net.new_cache(audio_features) / net.decode(tokens, cache)
    net.cross_attention(tokens, audio_features)
    cache.reorder(index); cache.length

``dtype=None`` means float32 on CPU and float16 on CUDA. Logits are always float32.

State-dict naming (the normalized form every checkpoint loader in ``checkpoints.py`` produces)::

    encoder.conv1.{weight,bias}                 (d, n_mels, 3)
    encoder.conv2.{weight,bias}                 (d, d, 3), stride 2
    encoder.positional_embedding                (n_audio_ctx, d)   buffer
    encoder.layers.{i}.self_attn.{q_proj,k_proj,v_proj,out_proj}.{weight,bias}  (k_proj: no bias)
    encoder.layers.{i}.self_attn_norm.{weight,bias}
    encoder.layers.{i}.mlp.{fc1,fc2}.{weight,bias}
    encoder.layers.{i}.mlp_norm.{weight,bias}
    encoder.final_norm.{weight,bias}
    decoder.embed_tokens.weight                 (n_vocab, d), tied output projection
    decoder.positional_embedding                (n_text_ctx, d)    learned parameter
    decoder.layers.{i}.self_attn.* / self_attn_norm.* / cross_attn.* / cross_attn_norm.*
    decoder.layers.{i}.mlp.* / mlp_norm.*
    decoder.final_norm.{weight,bias}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from oasr.layers import (
    GELUMLP,
    Conv1d,
    Embedding,
    KVCache,
    LayerNorm,
    MultiHeadAttention,
    add_norm,
    default_dtype,
    gelu,
    sinusoids,
)
from oasr.layers.attention import fixed_shape_attention
from oasr_models_whisper.network import WhisperDims

if TYPE_CHECKING:
    from oasr_models_whisper.checkpoints import LoadedWhisper


def default_alignment_heads(dims: WhisperDims) -> torch.Tensor:
    """openai-whisper's fallback: every head of the last half of the decoder layers."""
    layers = range(dims.n_text_layer // 2, dims.n_text_layer)
    pairs = [(layer, head) for layer in layers for head in range(dims.n_text_head)]
    return torch.tensor(pairs, dtype=torch.long).reshape(-1, 2)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d: int, n_head: int, cross: bool, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.self_attn = MultiHeadAttention(d, n_head, key_bias=False, **kw)
        self.self_attn_norm = LayerNorm(d, **kw)
        self.cross_attn = MultiHeadAttention(d, n_head, key_bias=False, **kw) if cross else None
        self.cross_attn_norm = LayerNorm(d, **kw) if cross else None
        self.mlp = GELUMLP(d, 4 * d, **kw)
        self.mlp_norm = LayerNorm(d, **kw)


class WhisperEncoder(nn.Module):
    def __init__(self, dims: WhisperDims, device=None, dtype=None) -> None:
        super().__init__()
        d = dims.n_audio_state
        kw = {"device": device, "dtype": dtype}
        self.conv1 = Conv1d(dims.n_mels, d, kernel_size=3, padding=1, **kw)
        self.conv2 = Conv1d(d, d, kernel_size=3, stride=2, padding=1, **kw)
        self.register_buffer(
            "positional_embedding", sinusoids(dims.n_audio_ctx, d).to(device=device, dtype=dtype)
        )
        self.layers = nn.ModuleList(
            ResidualAttentionBlock(d, dims.n_audio_head, cross=False, **kw)
            for _ in range(dims.n_audio_layer)
        )
        self.final_norm = LayerNorm(d, **kw)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        x = gelu(self.conv1(mel.to(self.conv1.weight.dtype)))
        # contiguous (B, T, C): the transposed view would make every residual add of every layer
        # a strided kernel (on an H200 at batch 64 those adds took a quarter of the encoder)
        x = gelu(self.conv2(x)).transpose(1, 2).contiguous()
        if x.shape[1] != self.positional_embedding.shape[0]:
            raise ValueError(
                f"encoder expects {2 * self.positional_embedding.shape[0]} mel frames "
                f"(30 s, use pad_or_trim), got {mel.shape[-1]}"
            )
        x = x + self.positional_embedding.to(x.dtype)
        # each residual add and the norm after it in one op (add_norm: one kernel on CUDA with
        # oasr-kernels, exactly ``x + y`` then the norm otherwise)
        norms = [n for block in self.layers for n in (block.self_attn_norm, block.mlp_norm)]
        norms.append(self.final_norm)
        h = norms[0](x)
        for i, block in enumerate(self.layers):
            x, h = add_norm(x, block.self_attn(h), norms[2 * i + 1])
            x, h = add_norm(x, block.mlp(h), norms[2 * i + 2])
        return h


class WhisperDecoder(nn.Module):
    def __init__(self, dims: WhisperDims, device=None, dtype=None) -> None:
        super().__init__()
        d = dims.n_text_state
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = Embedding(dims.n_vocab, d, **kw)
        self.positional_embedding = nn.Parameter(torch.zeros(dims.n_text_ctx, d, **kw))
        self.layers = nn.ModuleList(
            ResidualAttentionBlock(d, dims.n_text_head, cross=True, **kw)
            for _ in range(dims.n_text_layer)
        )
        self.final_norm = LayerNorm(d, **kw)
        #: the output projection when it is not the float tied embedding: W8A8 quantization puts
        #: an int8 copy of ``embed_tokens.weight`` here (``WhisperNet.quantization_tied``); the
        #: embedding lookup itself stays float
        self.output_projection: nn.Module | None = None

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits of the final-normed hidden states ``h`` (the tied projection)."""
        if self.output_projection is not None:
            return self.output_projection(h)
        return self.embed_tokens.unembed(h)


def decoder_norms(dec: WhisperDecoder) -> list[nn.Module]:
    """The decoder's norms in the order a pass applies them (self-attention, cross-attention,
    MLP per layer, then the final norm): each follows a residual add (:func:`add_norm`)."""
    norms = [n for b in dec.layers for n in (b.self_attn_norm, b.cross_attn_norm, b.mlp_norm)]
    norms.append(dec.final_norm)
    return norms


class WhisperDecoderCache:
    """Per-layer self-attention :class:`KVCache` plus the cross-attention K/V of one batch of
    audio features (computed once in :meth:`WhisperNet.new_cache`)."""

    def __init__(self, cross_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.cross_kv = cross_kv
        self.self_kv = [KVCache() for _ in cross_kv]
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @property
    def batch_size(self) -> int:
        return self.cross_kv[0][0].shape[0] if self.cross_kv else 0

    def reorder(self, index: torch.Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (select, drop or duplicate rows)."""
        index = torch.as_tensor(index, dtype=torch.long)
        if self.cross_kv:
            index = index.to(self.cross_kv[0][0].device)
        n = self.batch_size
        identity = index.numel() == n and bool((index == torch.arange(n, device=index.device)).all())
        if identity:
            return
        self.cross_kv = [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.cross_kv]
        for kv in self.self_kv:
            kv.reorder(index)


class WhisperNet(nn.Module):
    """Whisper encoder-decoder. See the module docstring for the state-dict naming."""

    def __init__(
        self,
        dims: WhisperDims,
        alignment_heads: torch.Tensor | Sequence[Sequence[int]] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        dtype = dtype or default_dtype(device)
        self.dims = dims
        self.encoder = WhisperEncoder(dims, device=device, dtype=dtype)
        self.decoder = WhisperDecoder(dims, device=device, dtype=dtype)
        heads = (
            default_alignment_heads(dims)
            if alignment_heads is None
            else torch.as_tensor(alignment_heads, dtype=torch.long).reshape(-1, 2)
        )
        self.alignment_heads = heads.cpu()
        #: linears W8A8 quantization leaves in the model dtype (docs/quantization.md): the last
        #: encoder layer's MLP output projection, whose post-GELU inputs carry outlier channels
        #: (tiny.en: max / median channel range 320, every other linear below 81) that one int8
        #: step per token cannot resolve (tiny.en CPU int8 WER +0.57 points with it quantized,
        #: +0.28 without)
        self.quantization_keep = (f"encoder.layers.{dims.n_audio_layer - 1}.mlp.fc2",)
        #: the tied output projection, quantized as a linear of its own for int8 on the CPU (one
        #: scale per vocabulary row, two-term activations; docs/quantization.md): in float32 a
        #: decode step reads 51 864 x d weights there, the largest single read of a step
        self.quantization_tied = {"decoder.output_projection": "decoder.embed_tokens"}
        #: the decoder's linears stay float on a CPU without an int8 GEMM (int8 there is float32
        #: matmuls, slower at a decode step's few rows; docs/quantization.md): faster, and the
        #: decoder carries most of int8's error (tiny.en's 18 English recordings on an AVX2
        #: EPYC: 5.68 % WER against 5.97 % with them int8; float32 5.40 %)
        self.quantization_keep_without_int8_gemm = ("decoder.layers.*",)

    # -- WhisperNetwork ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.encoder.conv1.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder.conv1.weight.dtype

    @torch.no_grad()
    def encode(self, mel: torch.Tensor) -> torch.Tensor:
        """(B, n_mels, 3000) log-mel -> (B, n_audio_ctx, n_audio_state) in the network dtype."""
        if mel.dim() == 2:
            mel = mel.unsqueeze(0)
        if mel.shape[1] != self.dims.n_mels:
            raise ValueError(f"this model takes {self.dims.n_mels} mel bins, got {mel.shape[1]}")
        with fixed_shape_attention():  # always 1500 frames: cuDNN's attention is the faster one
            return self.encoder(mel.to(self.device))

    @torch.no_grad()
    def new_cache(self, audio_features: torch.Tensor) -> WhisperDecoderCache:
        feats = audio_features.to(device=self.device, dtype=self.dtype)
        cross = [block.cross_attn.project_kv(feats) for block in self.decoder.layers]
        return WhisperDecoderCache(cross)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, cache: WhisperDecoderCache) -> torch.Tensor:
        """Logits (B, T, n_vocab) float32 for ``tokens`` (B, T) following the cached positions."""
        tokens = tokens.to(self.device)
        offset = cache.length
        t = tokens.shape[1]
        if offset + t > self.dims.n_text_ctx:
            raise ValueError(
                f"decoder context is {self.dims.n_text_ctx} tokens; asked for {offset + t}"
            )
        dec = self.decoder
        x = dec.embed_tokens(tokens) + dec.positional_embedding[offset : offset + t]
        norms = decoder_norms(dec)
        h = norms[0](x)
        for i, block in enumerate(dec.layers):
            a = block.self_attn(h, cache=cache.self_kv[i], causal=True)
            x, h = add_norm(x, a, norms[3 * i + 1])
            with fixed_shape_attention():  # keys: always the encoder's 1500 frames
                a = block.cross_attn(h, static_kv=cache.cross_kv[i])
            x, h = add_norm(x, a, norms[3 * i + 2])
            x, h = add_norm(x, block.mlp(h), norms[3 * i + 3])
        cache._length = offset + t
        return dec.logits(h).float()

    @torch.no_grad()
    def cross_attention(self, tokens: torch.Tensor, audio_features: torch.Tensor) -> torch.Tensor:
        """Alignment-head cross-attention weights (B, n_heads, T, n_audio_ctx), float32."""
        tokens = tokens.to(self.device)
        feats = audio_features.to(device=self.device, dtype=self.dtype)
        heads = self.alignment_heads
        if heads.numel() == 0:
            b, t = tokens.shape
            return torch.zeros(b, 0, t, feats.shape[1], device=self.device)
        last = int(heads[:, 0].max())
        dec = self.decoder
        t = tokens.shape[1]
        x = dec.embed_tokens(tokens) + dec.positional_embedding[:t]
        per_layer: dict[int, torch.Tensor] = {}
        for i, block in enumerate(dec.layers[: last + 1]):
            x = x + block.self_attn(block.self_attn_norm(x), causal=True)
            out, w = block.cross_attn(block.cross_attn_norm(x), feats, need_weights=True)
            per_layer[i] = w
            x = x + out
            x = x + block.mlp(block.mlp_norm(x))
        return torch.stack([per_layer[int(li)][:, int(h)] for li, h in heads.tolist()], dim=1)


def build_network(
    loaded: LoadedWhisper,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> WhisperNet:
    """Instantiate :class:`WhisperNet` for ``loaded`` on ``device`` (``dtype=None``: fp32 on
    CPU, fp16 on CUDA) and copy the weights in (strict: every tensor must be present)."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    net = WhisperNet(loaded.dims, loaded.alignment_heads, device="meta", dtype=dtype)
    state = {
        k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype)
        for k, v in loaded.state_dict.items()
    }
    # assign=True adopts the tensors (no second copy); the network may share storage with
    # ``loaded`` when device and dtype already match.
    missing, unexpected = net.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        from oasr.errors import CheckpointError

        raise CheckpointError(
            f"whisper weights do not fit the network: missing {sorted(missing)[:8]}"
            f"{'...' if len(missing) > 8 else ''}, unexpected {sorted(unexpected)[:8]}"
            f"{'...' if len(unexpected) > 8 else ''}"
        )
    net.alignment_heads = torch.as_tensor(loaded.alignment_heads, dtype=torch.long).reshape(-1, 2).cpu()
    return net.eval().requires_grad_(False)

"""The Qwen2-Audio network on ``oasr.layers``: a Whisper-style audio encoder (two convolutions,
learned positions, pre-norm transformer layers, 2x average pooling), a linear projector into
the language model's width, and a Qwen2 decoder (RMSNorm, rotary positions, grouped-query
attention with q/k/v biases, gated SiLU feed-forward).

The decoder runs over the core executor's paged KV cache through an
:class:`oasr.executors.autoregressive.AttentionContext` (``Qwen2Decoder.forward``), or, for the
reference path in the tests, over plain :class:`oasr.layers.KVCache` objects."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers import Conv1d, Embedding, LayerNorm, Linear, MultiHeadAttention, gelu
from oasr.layers.fused import add_norm
from oasr.layers.llm import RMSNorm, RotaryEmbedding, SiLUGatedMLP, rotary_qk, signed_rotary_sin
from oasr_models_qwen.config import AudioDims, QwenAudioConfig, TextDims

__all__ = ["AudioEncoder", "Qwen2AudioNet", "Qwen2Decoder", "build_network", "encoder_lengths"]


def encoder_lengths(mel_frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid frames after the stride-2 convolution, audio tokens after pooling) for valid mel
    frame counts (``transformers``' ``_get_feat_extract_output_lengths``)."""
    conv = (mel_frames - 1) // 2 + 1
    return conv, (conv - 2) // 2 + 1


class _EncoderLayer(nn.Module):
    def __init__(self, dims: AudioDims, **kw: Any) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(dims.d_model, dims.heads, key_bias=False, **kw)
        self.self_attn_layer_norm = LayerNorm(dims.d_model, **kw)
        self.fc1 = Linear(dims.d_model, dims.ffn, **kw)
        self.fc2 = Linear(dims.ffn, dims.d_model, **kw)
        self.final_layer_norm = LayerNorm(dims.d_model, **kw)

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), key_padding_mask=key_padding_mask)
        x = x + self.fc2(gelu(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as transformers does, against fp16 overflow
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class AudioEncoder(nn.Module):
    """log-mel (B, n_mels, 3000) + valid frame counts (B,) -> audio states (B, 750, d_model)."""

    def __init__(self, dims: AudioDims, **kw: Any) -> None:
        super().__init__()
        self.dims = dims
        self.conv1 = Conv1d(dims.n_mels, dims.d_model, 3, padding=1, **kw)
        self.conv2 = Conv1d(dims.d_model, dims.d_model, 3, stride=2, padding=1, **kw)
        self.embed_positions = Embedding(dims.max_source_positions, dims.d_model, **kw)
        self.layers = nn.ModuleList([_EncoderLayer(dims, **kw) for _ in range(dims.layers)])
        self.layer_norm = LayerNorm(dims.d_model, **kw)

    def forward(self, mel: torch.Tensor, frames: torch.Tensor | None) -> torch.Tensor:
        """``frames`` None: every frame of every input is valid (no padding mask, so the
        attention runs unmasked: the flash / cuDNN kernels)."""
        x = gelu(self.conv1(mel))
        # contiguous (B, T, C): a transposed view made every residual add in the layers below
        # a strided elementwise kernel and every projection input a copy
        x = gelu(self.conv2(x)).transpose(1, 2).contiguous()
        if self.dims.scale_embedding:
            x = x * self.dims.d_model**0.5
        x = x + self.embed_positions.weight[: x.shape[1]]
        padding = None
        if frames is not None:
            conv_len, _ = encoder_lengths(frames.to(x.device))
            padding = torch.arange(x.shape[1], device=x.device)[None, :] >= conv_len[:, None]
        for layer in self.layers:
            x = layer(x, padding)
        x = F.avg_pool1d(x.transpose(1, 2), 2, 2).transpose(1, 2)
        return self.layer_norm(x)


class _Attention(nn.Module):
    """q/k/v in one :class:`Linear` (``qkv_proj``: the checkpoint's q, k and v rows
    concatenated when loading; one GEMM per layer), ``o_proj``."""

    def __init__(self, dims: TextDims, **kw: Any) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = dims.heads, dims.kv_heads, dims.head_dim
        self.split = (dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.kv_heads * dims.head_dim)
        self.qkv_proj = Linear(dims.hidden, sum(self.split), bias=True, **kw)
        self.o_proj = Linear(dims.heads * dims.head_dim, dims.hidden, bias=False, **kw)


class _DecoderLayer(nn.Module):
    def __init__(self, dims: TextDims, **kw: Any) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(dims.hidden, dims.rms_eps, **kw)
        self.self_attn = _Attention(dims, **kw)
        self.post_attention_layernorm = RMSNorm(dims.hidden, dims.rms_eps, **kw)
        self.mlp = SiLUGatedMLP(dims.hidden, dims.intermediate, **kw)


class Qwen2Decoder(nn.Module):
    """Token embeddings, decoder layers, final norm (``transformers``' ``Qwen2Model``)."""

    def __init__(self, dims: TextDims, **kw: Any) -> None:
        super().__init__()
        self.dims = dims
        self.embed_tokens = Embedding(dims.vocab, dims.hidden, **kw)
        self.layers = nn.ModuleList([_DecoderLayer(dims, **kw) for _ in range(dims.layers)])
        self.norm = RMSNorm(dims.hidden, dims.rms_eps, **kw)
        self.rotary = RotaryEmbedding(dims.head_dim, dims.rope_theta, device=kw.get("device"))

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attend: Any,
                last_only: bool = False) -> torch.Tensor:  # fmt: skip
        """Hidden states (B, T, hidden) of inputs ``x`` (B, T, hidden) at ``positions`` (B, T);
        ``attend(layer, q (B, H, T, hd), k (B, T, kv*hd), v (B, T, kv*hd))`` -> (B, H, T, hd)
        stores the keys/values and attends (``AttentionContext.self_attention``).
        ``last_only``: the hidden state of the last position alone (B, 1, hidden), for a
        prefill that reads only the next token's logits: the last layer stores every key/value
        but attends with the last query only and runs its output projection and feed-forward
        on that one position (three quarters of that layer's GEMMs); ``attend`` then gets q
        (B, H, 1, hd)."""
        b, t, _ = x.shape
        cos, sin = self.rotary(positions, x.dtype)
        # rotary positions on the queries and keys together, in the projection's (B, T, heads,
        # head_dim) layout, the sine's sign folded once per forward (rotary_qk: one kernel per
        # layer on CUDA, four plus the keys' copy natively)
        cos, sin = cos[:, :, None], signed_rotary_sin(sin)[:, :, None]
        layers = list(self.layers)
        # each residual add goes into the next norm (add_norm: one kernel on CUDA, the same
        # values as the add then the norm)
        h = layers[0].input_layernorm(x) if layers else self.norm(x)
        for li, layer in enumerate(layers):
            att = layer.self_attn
            qkv = att.qkv_proj(h)
            nqk = att.split[0] + att.split[1]
            qk = qkv[..., :nqk].view(b, t, att.heads + att.kv_heads, att.head_dim)
            q, k = rotary_qk(qk, cos, sin, att.heads)
            if last_only and li == len(layers) - 1 and t > 1:
                q, x, t = q[:, -1:], x[:, -1:].contiguous(), 1
            out = attend(li, q.transpose(1, 2), k, qkv[..., nqk:])
            x, h = add_norm(att.o_proj(out.transpose(1, 2).reshape(b, t, -1)), x, layer.post_attention_layernorm)
            following = layers[li + 1].input_layernorm if li + 1 < len(layers) else self.norm
            x, h = add_norm(layer.mlp(h), x, following)
        return h


class Qwen2AudioNet(nn.Module):
    """Audio encoder + projector + Qwen2 decoder + output head."""

    #: kept in the model dtype under quantization: the audio-to-text projector and the LM head
    quantization_keep = ("projector", "lm_head")

    def __init__(self, config: QwenAudioConfig, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.config = config
        self.audio_tower = AudioEncoder(config.audio, **kw)
        self.projector = Linear(config.audio.d_model, config.text.hidden, **kw)
        self.decoder = Qwen2Decoder(config.text, **kw)
        self.lm_head = None if config.text.tie_embeddings else Linear(config.text.hidden, config.text.vocab, bias=False, **kw)

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self.projector.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.projector.weight.dtype

    def encode(self, mel: torch.Tensor, frames: torch.Tensor | None) -> torch.Tensor:
        """Audio embeddings in the decoder's width (B, 750, hidden); ``frames`` (B,) valid mel
        frames per input, or None when all are valid."""
        return self.projector(self.audio_tower(mel, frames))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.decoder.embed_tokens.unembed(hidden)
        return self.lm_head(hidden)


def fuse_weights(weights: dict[str, Any], layers: int) -> dict[str, Any]:
    """The checkpoint's per-projection decoder weights concatenated into the network's fused
    ones (``qkv_proj`` from q/k/v, ``gate_up_proj`` from gate/up); other names unchanged."""
    out = dict(weights)
    for i in range(layers):
        pre = f"decoder.layers.{i}."
        fused = (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                 ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")))  # fmt: skip
        for name, parts in fused:
            for kind in ("weight", "bias"):
                keys = [f"{pre}{p}.{kind}" for p in parts]
                if all(k in out for k in keys):
                    out[f"{pre}{name}.{kind}"] = torch.cat([out.pop(k) for k in keys])
    return out


def build_network(loaded: Any, device: torch.device | str, dtype: torch.dtype) -> Qwen2AudioNet:
    """The network of a :class:`~oasr_models_qwen.checkpoints.LoadedQwenAudio`, its weights
    loaded (every parameter must be in the checkpoint)."""
    from oasr.errors import CheckpointError

    with torch.device("meta"):
        net = Qwen2AudioNet(loaded.config, dtype=dtype)
    weights = fuse_weights(loaded.weights, loaded.config.text.layers)
    expected = {k for k in net.state_dict() if not k.endswith("inv_freq")}
    missing = sorted(expected - weights.keys())
    if missing:
        name = missing[0].replace("qkv_proj", "q_proj/k_proj/v_proj").replace("gate_up_proj", "gate_proj/up_proj")
        raise CheckpointError(f"{loaded.path}: the checkpoint has no weight {name!r} "
                              f"({len(missing)} missing)")  # fmt: skip
    state = {k: weights[k].to(dtype) for k in expected}
    net.load_state_dict(state, strict=False, assign=True)
    net.decoder.rotary = RotaryEmbedding(loaded.config.text.head_dim, loaded.config.text.rope_theta)
    return net.to(device).eval()

"""icefall's reworked Conformer transducer (``pruned_transducer_stateless2`` and the recipes
that import its ``conformer.py``: stateless3, 4, 6 ...), offline.

The state dict is icefall's (``encoder.encoder_embed.*``, ``encoder.encoder.layers.{i}.*``,
``decoder.*``, ``joiner.*``). Its ``Scaled*`` layers store a ``weight`` and a log-scale
(``weight_scale``, ``bias_scale``; ``ScaledEmbedding.scale``): they are folded into plain
weights once at load (``w * exp(weight_scale)``, as icefall computes them in every forward), so
the network runs on ``oasr.layers`` with no per-call rescaling. Training-only pieces
(activation balancers, dropout, layer dropout) are identities at inference.

Network: Conv2dSubsampling (three 3x3 convolutions with DoubleSwish, x4: ``((T - 1) // 2 - 1)
// 2`` frames), Linear, BasicNorm; Transformer-XL relative positions (sinusoids for offsets
``T - 1 .. -(T - 1)``, ``pos_bias_u/v``); per layer: macaron feed-forward, relative-position
self-attention, convolution module (pointwise GLU, depthwise, DoubleSwish, pointwise), feed-forward
(both full residual steps), BasicNorm. No final norm. The decoder is the stateless one (a
depthwise convolution over the last ``context_size`` embeddings, ReLU) and the joiner icefall's
(tanh, linear).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oasr.errors import CheckpointError
from oasr.layers import DepthwiseConv1d, Embedding, Linear
from oasr_models_icefall.nn import context_conv


def double_swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x - 1.0)


@dataclass(frozen=True)
class ConformerConfig:
    feature_dim: int = 80
    layer_channels: tuple[int, int, int] = (8, 32, 128)
    d_model: int = 512
    nhead: int = 8
    dim_feedforward: int = 2048
    num_layers: int = 12
    kernel: int = 31
    causal_conv: bool = False
    vocab_size: int = 500
    blank_id: int = 0
    decoder_dim: int = 512
    context_size: int = 2
    joiner_dim: int = 512
    # what the model class reads of every icefall config
    use_transducer: bool = True
    use_ctc: bool = False
    causal: bool = False  # no chunked streaming for this encoder
    encoder: str = "conformer"

    @property
    def output_dim(self) -> int:
        return self.d_model

    @property
    def num_encoder_layers(self) -> tuple[int, ...]:
        return (self.num_layers,)

    @property
    def downsampling_factor(self) -> tuple[int, ...]:
        return (1,)


class BasicNorm(nn.Module):
    """``x * (mean(x^2) + exp(eps))^-1/2`` (icefall's BasicNorm; ``eps`` is stored as a log)."""

    def __init__(self) -> None:
        super().__init__()
        self.eps = nn.Parameter(torch.tensor(math.log(0.25)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in float32, as under icefall's fp16 autocast
        scale = (x.float().pow(2).mean(dim=-1, keepdim=True) + self.eps.float().exp()).rsqrt()
        return x * scale.to(x.dtype)


class Subsampling(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        c1, c2, c3 = cfg.layer_channels
        self.conv0 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv1 = nn.Conv2d(c1, c2, 3, stride=2)
        self.conv2 = nn.Conv2d(c2, c3, 3, stride=2)
        self.out = Linear(c3 * (((cfg.feature_dim - 1) // 2 - 1) // 2), cfg.d_model)
        self.out_norm = BasicNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = double_swish(self.conv0(x.unsqueeze(1)))
        x = double_swish(self.conv1(x))
        x = double_swish(self.conv2(x))
        b, c, t, f = x.shape
        return self.out_norm(self.out(x.transpose(1, 2).reshape(b, t, c * f)))


def rel_positions(t: int, d: int, device, dtype) -> torch.Tensor:
    """(2t - 1, d) sinusoids of relative positions t - 1, ..., 0, ..., -(t - 1)."""
    pos = torch.arange(t - 1, -t, -1, dtype=torch.float32, device=device).unsqueeze(1)
    div = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=device) * -(math.log(10000.0) / d))
    pe = torch.zeros(2 * t - 1, d, device=device)
    pe[:, 0::2] = torch.sin(pos * div)
    pe[:, 1::2] = torch.cos(pos * div)
    return pe.to(dtype)


class RelSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, d // heads
        self.in_proj = Linear(d, 3 * d)
        self.out_proj = Linear(d, d)
        self.linear_pos = Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(heads, d // heads))
        self.pos_bias_v = nn.Parameter(torch.zeros(heads, d // heads))

    def forward(self, x: torch.Tensor, pos: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        h, hd = self.heads, self.head_dim
        q, k, v = self.in_proj(x).chunk(3, dim=-1)
        q = (q * hd**-0.5).reshape(b, t, h, hd)
        k = k.reshape(b, t, h, hd).permute(0, 2, 3, 1)
        v = v.reshape(b, t, h, hd).transpose(1, 2)
        p = self.linear_pos(pos).reshape(1, -1, h, hd).permute(0, 2, 3, 1)  # (1, H, hd, 2t - 1)
        ac = (q + self.pos_bias_u).transpose(1, 2) @ k
        bd = ((q + self.pos_bias_v).transpose(1, 2) @ p).contiguous()
        n = bd.shape[-1]
        bd = bd.as_strided((b, h, t, t), (h * t * n, t * n, n - 1, 1), bd.storage_offset() + t - 1)
        scores = ac + bd
        if key_padding is not None:
            scores = scores.masked_fill(key_padding[:, None, None, :], float("-inf"))
        w = scores.softmax(dim=-1)
        return self.out_proj((w @ v).transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.w1 = Linear(d, hidden)
        self.w2 = Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(double_swish(self.w1(x)))


class ConvModule(nn.Module):
    def __init__(self, d: int, kernel: int, causal: bool) -> None:
        super().__init__()
        self.causal, self.kernel = causal, kernel
        self.pointwise_conv1 = Linear(d, 2 * d)
        self.depthwise_conv = DepthwiseConv1d(d, kernel, padding=0 if causal else (kernel - 1) // 2)
        self.pointwise_conv2 = Linear(d, d)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        x = F.glu(self.pointwise_conv1(x), dim=-1)
        if valid is not None:
            x = x * valid[:, :, None].to(x.dtype)
        x = x.transpose(1, 2)
        if self.causal:
            x = F.pad(x, (self.kernel - 1, 0))
        x = double_swish(self.depthwise_conv(x)).transpose(1, 2)
        return self.pointwise_conv2(x)


class ConformerLayer(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.feed_forward_macaron = FeedForward(d, cfg.dim_feedforward)
        self.self_attn = RelSelfAttention(d, cfg.nhead)
        self.conv_module = ConvModule(d, cfg.kernel, cfg.causal_conv)
        self.feed_forward = FeedForward(d, cfg.dim_feedforward)
        self.norm_final = BasicNorm()

    def forward(self, x, pos, key_padding, valid) -> torch.Tensor:
        x = x + self.feed_forward_macaron(x)
        x = x + self.self_attn(x, pos, key_padding)
        x = x + self.conv_module(x, valid)
        x = x + self.feed_forward(x)
        return self.norm_final(x)


class ConformerEncoder(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.d_model = cfg.d_model
        self.encoder_embed = Subsampling(cfg)
        self.layers = nn.ModuleList(ConformerLayer(cfg) for _ in range(cfg.num_layers))

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if feats.shape[0] > 1:  # the first convolution zero-pads each row, as for a batch of one
            keep = torch.arange(feats.shape[1], device=feats.device)[None, :] < lengths[:, None]
            feats = feats * keep[:, :, None].to(feats.dtype)
        x = self.encoder_embed(feats)
        lengths = (((lengths - 1) >> 1) - 1) >> 1
        t = x.shape[1]
        pos = rel_positions(t, self.d_model, x.device, x.dtype)
        valid = key_padding = None
        if x.shape[0] > 1:
            valid = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
            key_padding = ~valid
        for layer in self.layers:
            x = layer(x, pos, key_padding, valid)
        return x, lengths


class ConformerDecoder(nn.Module):
    """Stateless decoder: embedding, depthwise conv over ``context_size`` tokens, ReLU."""

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.context_size = cfg.context_size
        self.embedding = Embedding(cfg.vocab_size, cfg.decoder_dim)
        if cfg.context_size > 1:
            self.conv = nn.Conv1d(cfg.decoder_dim, cfg.decoder_dim, cfg.context_size,
                                  groups=cfg.decoder_dim, bias=False)  # fmt: skip

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        emb = self.embedding(context.clamp(min=0)) * (context >= 0).unsqueeze(-1).to(self.embedding.weight.dtype)
        if self.context_size > 1:
            return torch.relu(context_conv(emb, self.conv))
        return torch.relu(emb[:, 0])


class ConformerJoiner(nn.Module):
    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.encoder_proj = Linear(cfg.d_model, cfg.joiner_dim)
        self.decoder_proj = Linear(cfg.decoder_dim, cfg.joiner_dim)
        self.output_linear = Linear(cfg.joiner_dim, cfg.vocab_size)

    def forward(self, enc_projected: torch.Tensor, dec_projected: torch.Tensor) -> torch.Tensor:
        return self.output_linear(torch.tanh(enc_projected + dec_projected))


class ConformerTransducerNet(nn.Module):
    """Same surface as :class:`oasr_models_icefall.nn.IcefallNet` (``encode``, ``decoder``,
    ``joiner``), offline only."""

    #: kept in the model dtype under quantization: the subsampling output and the joiner
    quantization_keep = ("encoder.encoder_embed.out", "joiner.*")

    def __init__(self, cfg: ConformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = ConformerEncoder(cfg)
        self.decoder = ConformerDecoder(cfg)
        self.joiner = ConformerJoiner(cfg)

    @property
    def device(self) -> torch.device:
        return self.joiner.output_linear.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.joiner.output_linear.weight.dtype

    def encode(self, feats: torch.Tensor, lengths: torch.Tensor, chunk_size: int = -1,
               left_context_frames: int = -1, uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return self.encoder(feats, lengths)


# -- loading ---------------------------------------------------------------------------------------


def is_conformer_state(state: dict[str, Any]) -> bool:
    return "encoder.encoder_embed.out.weight" in state and any(k.startswith("encoder.encoder.layers.") for k in state)


def _scaled(state: dict[str, Any], prefix: str, bias: bool = True) -> dict[str, torch.Tensor]:
    """``prefix.weight`` (and ``.bias``) with their icefall log-scales folded in."""
    out = {}
    w = state[prefix + ".weight"]
    ws = state.get(prefix + ".weight_scale")
    out["weight"] = w * ws.exp() if ws is not None else w
    if bias and prefix + ".bias" in state:
        b = state[prefix + ".bias"]
        bs = state.get(prefix + ".bias_scale")
        out["bias"] = b * bs.exp() if bs is not None else b
    return out


def infer_conformer_config(state: dict[str, Any], override: dict[str, Any] | None = None) -> ConformerConfig:
    override = override or {}
    try:
        d = state["encoder.encoder_embed.out.weight"].shape[0]
        layers = len({int(m.group(1)) for k in state if (m := re.match(r"encoder\.encoder\.layers\.(\d+)\.", k))})
        u = state["encoder.encoder.layers.0.self_attn.pos_bias_u"].shape
        ff = state["encoder.encoder.layers.0.feed_forward.0.weight"].shape[0]
        kernel = state["encoder.encoder.layers.0.conv_module.depthwise_conv.weight"].shape[-1]
        c = tuple(state[f"encoder.encoder_embed.conv.{i}.weight"].shape[0] for i in (0, 3, 6))
        vocab, joiner_dim = state["joiner.output_linear.weight"].shape
        decoder_dim = state["decoder.embedding.weight"].shape[1]
        context = state["decoder.conv.weight"].shape[-1] if "decoder.conv.weight" in state else 1
    except KeyError as exc:
        raise CheckpointError(f"the conformer transducer checkpoint has no tensor {exc}; it is not an "
                              f"icefall pruned_transducer_stateless2-style state dict") from None
    return ConformerConfig(
        feature_dim=int(override.get("feature_dim", 80)), layer_channels=c, d_model=int(d),
        nhead=int(u[0]), dim_feedforward=int(ff), num_layers=layers, kernel=int(kernel),
        causal_conv=bool(override.get("causal", False)), vocab_size=int(vocab),
        blank_id=int(override.get("blank_id", 0)), decoder_dim=int(decoder_dim),
        context_size=int(context), joiner_dim=int(joiner_dim),
    )  # fmt: skip


def convert_conformer_state(state: dict[str, Any], cfg: ConformerConfig) -> dict[str, torch.Tensor]:
    """icefall names and scales -> this module's plain weights. Encoder, decoder or joiner
    tensors this layout does not know (another recipe's variant) are refused by name."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()

    class _Seen(dict):
        def __getitem__(self, key: str) -> Any:
            used.add(key)
            return super().__getitem__(key)

        def get(self, key: str, default: Any = None) -> Any:
            used.add(key)
            return super().get(key, default)

    state = _Seen(state)

    def put(dst: str, src: str, *, bias: bool = True, squeeze: bool = False) -> None:
        for name, t in _scaled(state, src, bias).items():
            out[f"{dst}.{name}"] = t.squeeze(-1) if squeeze and name == "weight" else t

    for i, j in ((0, 0), (1, 3), (2, 6)):
        put(f"encoder.encoder_embed.conv{i}", f"encoder.encoder_embed.conv.{j}")
    put("encoder.encoder_embed.out", "encoder.encoder_embed.out")
    out["encoder.encoder_embed.out_norm.eps"] = state["encoder.encoder_embed.out_norm.eps"]
    for n in range(cfg.num_layers):
        s, d = f"encoder.encoder.layers.{n}", f"encoder.layers.{n}"
        for ff in ("feed_forward", "feed_forward_macaron"):
            put(f"{d}.{ff}.w1", f"{s}.{ff}.0")
            put(f"{d}.{ff}.w2", f"{s}.{ff}.4")
        a = f"{s}.self_attn"
        put(f"{d}.self_attn.in_proj", f"{a}.in_proj")
        put(f"{d}.self_attn.out_proj", f"{a}.out_proj")
        put(f"{d}.self_attn.linear_pos", f"{a}.linear_pos", bias=False)
        for uv in ("u", "v"):
            scale = state.get(f"{a}.pos_bias_{uv}_scale")
            bias = state[f"{a}.pos_bias_{uv}"]
            out[f"{d}.self_attn.pos_bias_{uv}"] = bias * scale.exp() if scale is not None else bias
        put(f"{d}.conv_module.pointwise_conv1", f"{s}.conv_module.pointwise_conv1", squeeze=True)
        put(f"{d}.conv_module.depthwise_conv", f"{s}.conv_module.depthwise_conv")
        put(f"{d}.conv_module.pointwise_conv2", f"{s}.conv_module.pointwise_conv2", squeeze=True)
        out[f"{d}.norm_final.eps"] = state[f"{s}.norm_final.eps"]
    emb = state["decoder.embedding.weight"]
    scale = state.get("decoder.embedding.scale")
    out["decoder.embedding.weight"] = emb * scale.exp() if scale is not None else emb
    if cfg.context_size > 1:
        out["decoder.conv.weight"] = _scaled(state, "decoder.conv", bias=False)["weight"]
    for p in ("encoder_proj", "decoder_proj", "output_linear"):
        put(f"joiner.{p}", f"joiner.{p}")
    unknown = sorted(k for k in state if k.startswith(("encoder.", "decoder.", "joiner.")) and k not in used)
    if unknown:
        raise CheckpointError(
            f"this conformer checkpoint has tensors the pruned_transducer_stateless2 layout does not "
            f"have ({', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}): a recipe variant "
            f"oasr-models-icefall does not load yet")
    return out


__all__ = ["ConformerConfig", "ConformerTransducerNet", "convert_conformer_state", "infer_conformer_config",
           "is_conformer_state"]

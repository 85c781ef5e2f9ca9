"""icefall's Zipformer2 encoder, stateless decoder, joiner and CTC head, on ``oasr.layers``.

Parameter names are icefall's (``egs/librispeech/ASR/zipformer``: ``encoder_embed.*``,
``encoder.encoders.{i}[.encoder].layers.{j}.*``, ``decoder.*``, ``joiner.*``, ``ctc_output.1.*``),
so a released state dict loads as it is. Training-only pieces (balancers, whitening, dropout,
layer skipping, feature masks) are identities at inference and are left out; the bypass scales
are used as stored (icefall clamps them only while training).

Layout is (B, T, C) throughout. Two entry points:

* :meth:`ZipformerEncoder.forward` — whole utterances, with icefall's optional chunk mask
  (``chunk_size`` / ``left_context_frames`` at the 50 Hz embed rate) for causal models;
* :meth:`ZipformerEncoder.streaming_forward` — one chunk per stream with per-layer caches of a
  fixed left context (icefall's ``streaming_forward``), so streams of any age share one batch.

Deliberate difference from icefall's *batched* forward (equal to icefall run one utterance at a
time): frames past a row's length are never mixed into its valid frames (the ConvNeXt's right
context and the downsamplers' last group read the row's own edge, as for a batch of one), so a
result never depends on the other rows of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers import DepthwiseConv1d, Embedding, Linear

LOG_EPS = math.log(1e-10)  # icefall's feature padding value


def swoosh_l(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x - 4)) - 0.08 x - 0.035`` (four elementwise passes)."""
    return torch.add(F.softplus(x - 4.0), x, alpha=-0.08).sub_(0.035)


def swoosh_r(x: torch.Tensor) -> torch.Tensor:
    """``log(1 + exp(x - 1)) - 0.08 x - 0.313261687``."""
    return torch.add(F.softplus(x - 1.0), x, alpha=-0.08).sub_(0.313261687)


@dataclass(frozen=True)
class ZipformerConfig:
    """Every hyper-parameter the network needs (see ``config.infer_config``)."""

    feature_dim: int = 80
    layer_channels: tuple[int, int, int] = (8, 32, 128)  # encoder_embed conv channels
    downsampling_factor: tuple[int, ...] = (1, 2, 4, 8, 4, 2)
    num_encoder_layers: tuple[int, ...] = (2, 2, 3, 4, 3, 2)
    encoder_dim: tuple[int, ...] = (192, 256, 384, 512, 384, 256)
    num_heads: tuple[int, ...] = (4, 4, 4, 8, 4, 4)
    query_head_dim: tuple[int, ...] = (32,) * 6
    pos_head_dim: tuple[int, ...] = (4,) * 6
    value_head_dim: tuple[int, ...] = (12,) * 6
    feedforward_dim: tuple[int, ...] = (512, 768, 1024, 1536, 1024, 768)
    cnn_module_kernel: tuple[int, ...] = (31, 31, 15, 15, 15, 31)
    pos_dim: int = 48
    causal: bool = False
    vocab_size: int = 500
    blank_id: int = 0
    use_transducer: bool = True
    decoder_dim: int = 512
    context_size: int = 2
    joiner_dim: int = 512
    use_ctc: bool = False
    use_attention_decoder: bool = False

    @property
    def output_dim(self) -> int:
        return max(self.encoder_dim)

    @property
    def num_stacks(self) -> int:
        return len(self.encoder_dim)


class BiasNorm(nn.Module):
    """``x * mean((x - bias)^2)^-1/2 * exp(log_scale)`` over the channel dimension."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.tensor(1.0))
        self.bias = nn.Parameter(torch.zeros(channels))

    def _gain(self) -> torch.Tensor:
        """``sqrt(C) * exp(log_scale)`` in float32, kept while the parameter is unchanged."""
        p = self.log_scale
        key = (p.data_ptr(), p._version, p.device)
        last = self.__dict__.get("_gain_cache")
        if last is None or last[0] != key:
            last = self.__dict__["_gain_cache"] = (key, p.float().exp() * math.sqrt(self.bias.numel()))
        return last[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # mean((x - b)^2)^-1/2 = sqrt(C) / |x - b|; the norm accumulates in float32 (icefall runs
        # fp16 under autocast, which does these statistics in fp32): 5 kernels instead of 11
        n = torch.linalg.vector_norm(x - self.bias, dim=-1, keepdim=True, dtype=torch.float32)
        return x * (self._gain() / n).to(x.dtype)


class Bypass(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bypass_scale = nn.Parameter(torch.full((channels,), 0.5))

    def forward(self, orig: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return torch.lerp(orig, x, self.bypass_scale)  # orig + (x - orig) * scale, one kernel


def _valid_mask(lengths: torch.Tensor, t: int) -> torch.Tensor:
    """(B, T) True at valid frames."""
    return torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]


def _hold_last(x: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """Frames past each row's length replaced by the row's last valid frame (what icefall's
    downsampler pads a lone utterance with)."""
    if lengths is None:
        return x
    t = x.shape[1]
    idx = torch.minimum(torch.arange(t, device=x.device)[None, :], (lengths - 1).clamp(min=0)[:, None])
    return torch.gather(x, 1, idx[:, :, None].expand(-1, -1, x.shape[2]))


# -- front end ---------------------------------------------------------------------------------------


class ConvNeXt(nn.Module):
    def __init__(self, channels: int, hidden_ratio: int = 3, kernel: int = 7) -> None:
        super().__init__()
        self.padding = kernel // 2
        hidden = channels * hidden_ratio
        self.depthwise_conv = nn.Conv2d(channels, channels, kernel, groups=channels, padding=self.padding)
        self.pointwise_conv1 = nn.Conv2d(channels, hidden, 1)
        self.pointwise_conv2 = nn.Conv2d(hidden, channels, 1)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise_conv2(swoosh_l(self.pointwise_conv1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._body(self.depthwise_conv(x))

    def streaming_forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, C, T + pad, F): the last ``pad`` frames are right context; cache (B, C, pad, F)."""
        p = self.padding
        t = x.shape[2] - p
        bypass = x[:, :, :t]
        x = torch.cat([cache, x], dim=2)
        cache = x[:, :, t : t + p]
        w = self.depthwise_conv
        y = F.conv2d(x, w.weight, w.bias, padding=(0, p), groups=w.groups)
        return bypass + self._body(y), cache


class Conv2dSubsampling(nn.Module):
    """(B, T, F) fbank -> (B, (T - 7) // 2, C): three convolutions, a ConvNeXt, a projection and
    a BiasNorm (``encoder_embed``)."""

    def __init__(self, cfg: ZipformerConfig) -> None:
        super().__init__()
        c1, c2, c3 = cfg.layer_channels
        self.conv = nn.ModuleDict({
            "0": nn.Conv2d(1, c1, 3, padding=(0, 1)),
            "4": nn.Conv2d(c1, c2, 3, stride=2),
            "7": nn.Conv2d(c2, c3, 3, stride=(1, 2)),
        })  # fmt: skip
        self.convnext = ConvNeXt(c3)
        self.out_width = (((cfg.feature_dim - 1) // 2) - 1) // 2
        self.channels = c3
        self.out = Linear(self.out_width * c3, cfg.encoder_dim[0])
        self.out_norm = BiasNorm(cfg.encoder_dim[0])

    def _convs(self, x: torch.Tensor) -> torch.Tensor:
        x = swoosh_r(self.conv["0"](x.unsqueeze(1)))
        x = swoosh_r(self.conv["4"](x))
        return swoosh_r(self.conv["7"](x))

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, f = x.shape
        return self.out_norm(self.out(x.transpose(1, 2).reshape(b, t, c * f)))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor,
                uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        x = self._convs(x)
        lengths = (lengths - 7) // 2
        if x.shape[0] > 1 and not uniform:  # the ConvNeXt pads each row with zeros, as for a batch of one
            x = x * _valid_mask(lengths, x.shape[2])[:, None, :, None].to(x.dtype)
        return self._project(self.convnext(x)), lengths

    def streaming_forward(self, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, 2 * chunk + 13, F) -> (B, chunk, C) and the new ConvNeXt cache."""
        x, cache = self.convnext.streaming_forward(self._convs(x), cache)
        return self._project(x), cache

    def initial_cache(self, batch: int, device, dtype) -> torch.Tensor:
        return torch.zeros(batch, self.channels, self.convnext.padding, self.out_width, device=device, dtype=dtype)


# -- encoder layer -------------------------------------------------------------------------------------


def compact_rel_pos(t_left: int, t: int, dim: int, device, dtype) -> torch.Tensor:
    """icefall's CompactRelPositionalEncoding for relative offsets ``t_left - 1 .. -(t - 1)``
    (keys at ``-(t_left - 1) .. t - 1`` seen from the queries): (2t - 1 + left, dim), rows for
    offsets from ``t_left - 1`` down... in icefall's order (most negative key offset first)."""
    x = torch.arange(-(t_left - 1), t, device=device, dtype=torch.float32).unsqueeze(1)
    freqs = 1 + torch.arange(dim // 2, device=device)
    comp = dim**0.5
    xc = comp * x.sign() * ((x.abs() + comp).log() - math.log(comp))
    xa = (xc / (dim / (2.0 * math.pi))).atan()
    pe = torch.zeros(x.shape[0], dim, device=device)
    pe[:, 0::2] = (xa * freqs).cos()
    pe[:, 1::2] = (xa * freqs).sin()
    pe[:, -1] = 1.0
    return pe.to(dtype)


def _rel_shift(scores: torch.Tensor, k_len: int) -> torch.Tensor:
    """(B, H, T, n) scores per relative position -> (B, H, T, k_len) per key: out[i, j] =
    scores[i, j + T - 1 - i]."""
    b, h, t, n = scores.shape
    scores = scores.contiguous()
    return scores.as_strided((b, h, t, k_len), (h * t * n, t * n, n - 1, 1), scores.storage_offset() + t - 1)


class AttentionWeights(nn.Module):
    """``self_attn_weights``: softmax((q k^T) + rel-pos scores), masked with -1000 as icefall."""

    def __init__(self, dim: int, pos_dim: int, heads: int, qdim: int, pdim: int) -> None:
        super().__init__()
        self.heads, self.qdim, self.pdim = heads, qdim, pdim
        self.in_proj = Linear(dim, (2 * qdim + pdim) * heads)
        self.linear_pos = Linear(pos_dim, heads * pdim, bias=False)

    def _scores(self, x: torch.Tensor, pos: torch.Tensor, cached_key: torch.Tensor | None):
        b, t, _ = x.shape
        h, dq, dp = self.heads, self.qdim, self.pdim
        q, k, p = self.in_proj(x).split([h * dq, h * dq, h * dp], dim=-1)
        q = q.reshape(b, t, h, dq).transpose(1, 2)
        p = p.reshape(b, t, h, dp).transpose(1, 2)
        new_key = None
        if cached_key is not None:
            k = torch.cat([cached_key, k], dim=1)
            new_key = k[:, k.shape[1] - cached_key.shape[1] :]
        k_len = k.shape[1]
        k = k.reshape(b, k_len, h, dq).permute(0, 2, 3, 1)
        scores = q @ k
        scores += _rel_shift(p @ self._pos_proj(pos), k_len)  # in place: (B, H, T, T) is the largest tensor here
        return scores, new_key

    def _pos_proj(self, pos: torch.Tensor) -> torch.Tensor:
        """(H, dp, n) projected positional encoding; kept while ``pos`` is the same tensor (a
        streaming step passes the same one every step)."""
        w = self.linear_pos.weight
        last = self.__dict__.get("_pe")
        if last is not None and last[0] is pos and last[1] == (w.data_ptr(), w._version):
            return last[2]
        pe = self.linear_pos(pos).reshape(pos.shape[0], self.heads, self.pdim).permute(1, 2, 0)
        self.__dict__["_pe"] = (pos, (w.data_ptr(), w._version), pe)
        return pe

    def forward(self, x, pos, mask: torch.Tensor | None) -> torch.Tensor:
        scores, _ = self._scores(x, pos, None)
        if mask is not None:
            scores.masked_fill_(mask, -1000.0)
        return scores.softmax(dim=-1)

    def streaming_forward(self, x, pos, cached_key, mask):
        scores, new_key = self._scores(x, pos, cached_key)
        scores.masked_fill_(mask, -1000.0)
        return scores.softmax(dim=-1), new_key


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, vdim: int) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj = Linear(dim, heads * vdim)
        self.out_proj = Linear(heads * vdim, dim)

    def forward(self, x, weights, cached_val: torch.Tensor | None = None):
        b, t, _ = x.shape
        v = self.in_proj(x)
        new_val = None
        if cached_val is not None:
            v = torch.cat([cached_val, v], dim=1)
            new_val = v[:, v.shape[1] - cached_val.shape[1] :]
        v = v.reshape(b, v.shape[1], self.heads, -1).transpose(1, 2)
        out = (weights @ v).transpose(1, 2).reshape(b, t, -1)
        return self.out_proj(out), new_val


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.in_proj = Linear(dim, hidden)
        self.out_proj = Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(swoosh_l(self.in_proj(x)))


class NonlinAttention(nn.Module):
    """tanh-gated values mixed by the first head's attention weights."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.in_proj = Linear(dim, 3 * hidden)
        self.out_proj = Linear(hidden, dim)

    def forward(self, x, weights0, cached: torch.Tensor | None = None):
        s, v, y = self.in_proj(x).chunk(3, dim=-1)
        v = v * torch.tanh(s)
        new = None
        if cached is not None:
            v = torch.cat([cached, v], dim=1)
            new = v[:, v.shape[1] - cached.shape[1] :]
        return self.out_proj((weights0 @ v) * y), new


class ChunkCausalDepthwiseConv1d(nn.Module):
    """A causal depthwise convolution of half the kernel plus a chunk-local one scaled by a
    position-in-chunk factor (icefall's causal convolution)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.kernel = kernel
        self.causal_conv = DepthwiseConv1d(channels, (kernel + 1) // 2)
        self.chunkwise_conv = DepthwiseConv1d(channels, kernel, padding=kernel // 2)
        self.chunkwise_conv_scale = nn.Parameter(torch.zeros(2, channels, kernel))

    def _chunk_scale(self, chunk: int) -> torch.Tensor:
        """(C, chunk) scale of the chunk-local convolution; a function of the weights and the
        chunk size only, so kept per chunk size (a streaming step would rebuild it per layer)."""
        w = self.chunkwise_conv_scale
        key = (chunk, w.dtype, w.device, w.data_ptr(), w._version)
        cache = self.__dict__.setdefault("_scales", {})
        if key not in cache:
            if len(cache) > 16:
                cache.clear()
            cache[key] = self._build_chunk_scale(chunk)
        return cache[key]

    def _build_chunk_scale(self, chunk: int) -> torch.Tensor:
        left, right = self.chunkwise_conv_scale[0], self.chunkwise_conv_scale[1]
        if chunk < self.kernel:
            left, right = left[:, :chunk], right[:, -chunk:]
        else:
            pad = left.new_zeros(left.shape[0], chunk - self.kernel)
            left, right = torch.cat([left, pad], -1), torch.cat([pad, right], -1)
        return 1.0 + left + right

    def forward(self, x: torch.Tensor, chunk_size: int = -1) -> torch.Tensor:
        b, c, t = x.shape
        lp = self.kernel // 2
        if chunk_size < 0 or chunk_size > t:
            chunk_size = t
        rp = -t % chunk_size
        x = F.pad(x, (lp, rp))
        causal = self.causal_conv(x[..., : lp + t])
        n = (t + rp) // chunk_size
        xc = x[..., lp:].reshape(b, c, n, chunk_size).transpose(1, 2).reshape(b * n, c, chunk_size)
        xc = self.chunkwise_conv(xc) * self._chunk_scale(chunk_size)
        xc = xc.reshape(b, n, c, chunk_size).transpose(1, 2).reshape(b, c, n * chunk_size)[..., :t]
        return xc + causal

    def streaming_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, C, kernel // 2 + T): the cached left frames, then the chunk's -> (B, C, T)."""
        lp = self.kernel // 2
        return self.causal_conv(x) + self.chunkwise_conv(x[..., lp:]) * self._chunk_scale(x.shape[2] - lp)


class ConvolutionModule(nn.Module):
    def __init__(self, dim: int, kernel: int, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.in_proj = Linear(dim, 2 * dim)
        self.depthwise_conv = (ChunkCausalDepthwiseConv1d(dim, kernel) if causal
                               else DepthwiseConv1d(dim, kernel, padding=kernel // 2))  # fmt: skip
        self.out_proj = Linear(dim, dim)

    def _gate(self, x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
        x, s = self.in_proj(x).chunk(2, dim=-1)
        x = x * torch.sigmoid(s)
        if valid is not None:
            x = x * valid[:, :, None].to(x.dtype)
        return x.transpose(1, 2)

    def forward(self, x, valid: torch.Tensor | None, chunk_size: int = -1) -> torch.Tensor:
        x = self._gate(x, valid)
        x = self.depthwise_conv(x, chunk_size) if self.causal else self.depthwise_conv(x)
        return self.out_proj(swoosh_r(x.transpose(1, 2)))

    def streaming_forward(self, x, cache):
        """cache (B, kernel // 2, C): the last gated frames, time-major, so that the new cache is a
        view (one flat row per stream in the cache pool)."""
        x, s = self.in_proj(x).chunk(2, dim=-1)
        x = torch.cat([cache, x * torch.sigmoid(s)], dim=1)
        cache = x[:, x.shape[1] - cache.shape[1] :]
        x = self.depthwise_conv.streaming_forward(x.transpose(1, 2))
        return self.out_proj(swoosh_r(x.transpose(1, 2))), cache


class ZipformerEncoderLayer(nn.Module):
    def __init__(self, cfg: ZipformerConfig, i: int) -> None:
        super().__init__()
        d, ff = cfg.encoder_dim[i], cfg.feedforward_dim[i]
        h = cfg.num_heads[i]
        self.bypass = Bypass(d)
        self.bypass_mid = Bypass(d)
        self.bypass_scale = nn.Parameter(torch.full((d,), 0.5))  # stored by icefall, unused
        self.self_attn_weights = AttentionWeights(d, cfg.pos_dim, h, cfg.query_head_dim[i], cfg.pos_head_dim[i])
        self.self_attn1 = SelfAttention(d, h, cfg.value_head_dim[i])
        self.self_attn2 = SelfAttention(d, h, cfg.value_head_dim[i])
        self.feed_forward1 = FeedForward(d, ff * 3 // 4)
        self.feed_forward2 = FeedForward(d, ff)
        self.feed_forward3 = FeedForward(d, ff * 5 // 4)
        self.nonlin_attention = NonlinAttention(d, 3 * d // 4)
        self.conv_module1 = ConvolutionModule(d, cfg.cnn_module_kernel[i], cfg.causal)
        self.conv_module2 = ConvolutionModule(d, cfg.cnn_module_kernel[i], cfg.causal)
        self.norm = BiasNorm(d)

    def forward(self, src, pos, mask, valid, chunk_size: int = -1) -> torch.Tensor:
        orig = src
        w = self.self_attn_weights(src, pos, mask)
        src = src + self.feed_forward1(src)
        src = src + self.nonlin_attention(src, w[:, 0])[0]
        src = src + self.self_attn1(src, w)[0]
        src = src + self.conv_module1(src, valid, chunk_size)
        src = src + self.feed_forward2(src)
        src = self.bypass_mid(orig, src)
        src = src + self.self_attn2(src, w)[0]
        src = src + self.conv_module2(src, valid, chunk_size)
        src = src + self.feed_forward3(src)
        return self.bypass(orig, self.norm(src))

    def streaming_forward(self, src, pos, cache: list[torch.Tensor], mask):
        """cache: [key, nonlin, val1, val2, conv1, conv2] as (B, left, .) / (B, k // 2, C)."""
        orig = src
        w, key = self.self_attn_weights.streaming_forward(src, pos, cache[0], mask)
        src = src + self.feed_forward1(src)
        na, nonlin = self.nonlin_attention(src, w[:, 0], cache[1])
        src = src + na
        sa, val1 = self.self_attn1(src, w, cache[2])
        src = src + sa
        cv, conv1 = self.conv_module1.streaming_forward(src, cache[4])
        src = src + cv
        src = src + self.feed_forward2(src)
        src = self.bypass_mid(orig, src)
        sa, val2 = self.self_attn2(src, w, cache[3])
        src = src + sa
        cv, conv2 = self.conv_module2.streaming_forward(src, cache[5])
        src = src + cv
        src = src + self.feed_forward3(src)
        return self.bypass(orig, self.norm(src)), [key, nonlin, val1, val2, conv1, conv2]


class LayerStack(nn.Module):
    """icefall's ZipformerEncoder: layers sharing one relative positional encoding."""

    def __init__(self, cfg: ZipformerConfig, i: int) -> None:
        super().__init__()
        self.pos_dim = cfg.pos_dim
        self.layers = nn.ModuleList(ZipformerEncoderLayer(cfg, i) for _ in range(cfg.num_encoder_layers[i]))

    def forward(self, x, mask, valid, chunk_size: int) -> torch.Tensor:
        t = x.shape[1]
        pos = compact_rel_pos(t, t, self.pos_dim, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, pos, mask, valid, chunk_size)
        return x

    def streaming_forward(self, x, caches, left: int, mask):
        t = x.shape[1]
        key = (t, left, x.device, x.dtype)  # a streaming step's encoding: the same every step
        pos = self.__dict__.get("_pos")
        if pos is None or pos[0] != key:
            pos = self.__dict__["_pos"] = (key, compact_rel_pos(t + left, t, self.pos_dim, x.device, x.dtype))
        new = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, c = layer.streaming_forward(x, pos[1], cache, mask)
            new.append(c)
        return x, new


class SimpleDownsample(nn.Module):
    """Weighted sum of each group of ``ds`` frames (softmax of learnt weights), the last group
    padded with the last frame."""

    def __init__(self, ds: int) -> None:
        super().__init__()
        self.ds = ds
        self.bias = nn.Parameter(torch.zeros(ds))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        b, t, c = x.shape
        ds = self.ds
        n = (t + ds - 1) // ds
        x = _hold_last(x, lengths)
        if n * ds > t:
            x = torch.cat([x, x[:, -1:].expand(b, n * ds - t, c)], dim=1)
        return (x.reshape(b, n, ds, c) * self._weights(x.dtype)).sum(dim=2)

    def _weights(self, dtype: torch.dtype) -> torch.Tensor:
        """softmax(bias) as (ds, 1) in ``dtype``, kept while the parameter is unchanged."""
        p = self.bias
        key = (p.data_ptr(), p._version, p.device, dtype)
        last = self.__dict__.get("_w")
        if last is None or last[0] != key:
            last = self.__dict__["_w"] = (key, p.softmax(dim=0).to(dtype).unsqueeze(1))
        return last[1]


class DownsampledStack(nn.Module):
    """icefall's DownsampledZipformerEncoder: downsample, a layer stack, repeat, bypass."""

    def __init__(self, cfg: ZipformerConfig, i: int) -> None:
        super().__init__()
        self.ds = cfg.downsampling_factor[i]
        self.downsample = SimpleDownsample(self.ds)
        self.encoder = LayerStack(cfg, i)
        self.out_combiner = Bypass(cfg.encoder_dim[i])

    def forward(self, x, lengths, mask, valid, chunk_size: int) -> torch.Tensor:
        ds = self.ds
        y = self.downsample(x, lengths)
        y = self.encoder(y, None if mask is None else mask[..., ::ds, ::ds],
                         None if valid is None else valid[:, ::ds], chunk_size // ds)  # fmt: skip
        y = y.repeat_interleave(ds, dim=1)[:, : x.shape[1]]
        return self.out_combiner(x, y)

    def streaming_forward(self, x, caches, left: int, mask):
        ds = self.ds
        y, new = self.encoder.streaming_forward(self.downsample(x), caches, left // ds, mask[..., ::ds])
        y = y.repeat_interleave(ds, dim=1)[:, : x.shape[1]]
        return self.out_combiner(x, y), new


def _channels(x: torch.Tensor, c: int) -> torch.Tensor:
    if c <= x.shape[-1]:
        return x[..., :c]
    return torch.cat([x, x.new_zeros(*x.shape[:-1], c - x.shape[-1])], dim=-1)


class Zipformer(nn.Module):
    """The stacks (``encoder.encoders``) and the output downsampling (x2)."""

    def __init__(self, cfg: ZipformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoders = nn.ModuleList(
            DownsampledStack(cfg, i) if cfg.downsampling_factor[i] != 1 else LayerStack(cfg, i)
            for i in range(cfg.num_stacks)
        )
        self.downsample_output = SimpleDownsample(2)

    def _merge(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        dims = self.cfg.encoder_dim
        pieces, cur = [outputs[-1]], dims[-1]
        for i in range(len(dims) - 2, -1, -1):
            if dims[i] > cur:
                pieces.append(outputs[i][..., cur : dims[i]])
                cur = dims[i]
        return torch.cat(pieces, dim=-1)

    def chunk_mask(self, t: int, chunk_size: int, left_context_frames: int, device) -> torch.Tensor | None:
        """icefall's attention mask at the embed rate (True = masked), or None (full context)."""
        if chunk_size <= 0:
            return None
        left_chunks = left_context_frames // chunk_size if left_context_frames >= 0 else 1000000
        left_chunks = max(left_chunks, 1) if left_context_frames >= 0 else left_chunks
        c = torch.arange(t, device=device) // chunk_size
        return (c[None, :] > c[:, None]) | (c[None, :] < c[:, None] - left_chunks)

    def forward(self, x, lengths, chunk_size: int = -1, left_context_frames: int = -1, uniform: bool = False):
        """``uniform``: the caller knows every row has the full length (no padding), so no
        padding masks are built or applied (they would change nothing)."""
        b, t, _ = x.shape
        varied = b > 1 and not uniform
        valid = _valid_mask(lengths, t) if varied else None
        mask = self.chunk_mask(t, chunk_size, left_context_frames, x.device)
        # True = masked. Full context: the padded keys only, (B, 1, 1, T) broadcast over the
        # queries (no (B, 1, T, T) tensor to build and read in every layer); chunked: both
        attn_mask = None if valid is None else ~valid[:, None, None, :]
        if mask is not None:
            attn_mask = mask[None, None] if attn_mask is None else attn_mask | mask
        outputs = []
        for i, module in enumerate(self.encoders):
            x = _channels(x, self.cfg.encoder_dim[i])
            if isinstance(module, DownsampledStack):
                x = module(x, lengths if varied else None, attn_mask, valid, chunk_size)
            else:
                x = module(x, attn_mask, valid, chunk_size)
            outputs.append(x)
        x = self.downsample_output(self._merge(outputs), lengths if varied else None)
        return x, (lengths + 1) // 2

    def streaming_forward(self, x, caches: list[list[list[torch.Tensor]]], left: int,
                          processed: torch.Tensor):  # fmt: skip
        """One chunk of every row: x (B, chunk, C0), caches per stack per layer, ``left`` cached
        frames at the embed rate, ``processed`` (B,) embed frames each row saw before."""
        b, t, _ = x.shape
        old = (processed[:, None] <= torch.arange(left, device=x.device)[None, :]).flip(1)
        mask = torch.cat([old, old.new_zeros(b, t)], dim=1)[:, None, None, :]  # (B, 1, 1, left + t)
        outputs, new = [], []
        for i, module in enumerate(self.encoders):
            x = _channels(x, self.cfg.encoder_dim[i])
            x, c = module.streaming_forward(x, caches[i], left, mask)
            outputs.append(x)
            new.append(c)
        return self.downsample_output(self._merge(outputs)), new

    def initial_caches(self, batch: int, left: int, device, dtype) -> list[list[list[torch.Tensor]]]:
        cfg = self.cfg
        out = []
        for i in range(cfg.num_stacks):
            d, h, n = cfg.encoder_dim[i], cfg.num_heads[i], left // cfg.downsampling_factor[i]
            k = cfg.cnn_module_kernel[i] // 2
            z = lambda *s: torch.zeros(*s, device=device, dtype=dtype)  # noqa: E731
            out.append([
                [z(batch, n, h * cfg.query_head_dim[i]), z(batch, n, 3 * d // 4),
                 z(batch, n, h * cfg.value_head_dim[i]), z(batch, n, h * cfg.value_head_dim[i]),
                 z(batch, k, d), z(batch, k, d)]
                for _ in range(cfg.num_encoder_layers[i])
            ])  # fmt: skip
        return out


@dataclass
class StreamCaches:
    """Encoder caches of B streams: the ConvNeXt's left frames (B, C, 3, F'), per stack and
    layer ``[key, nonlin, val1, val2, conv1, conv2]`` (batch first), and the embed frames each
    stream has seen (masks cache slots not yet filled)."""

    embed: torch.Tensor
    layers: list[list[list[torch.Tensor]]]
    processed: torch.Tensor

    def row(self, i: int) -> StreamCaches:
        """Row ``i`` as views (no copy: the next step concatenates them again)."""
        s = slice(i, i + 1)
        return StreamCaches(self.embed[s], [[[t[s] for t in layer] for layer in stack]
                                            for stack in self.layers], self.processed[s])

    @staticmethod
    def cat(items: list[StreamCaches]) -> StreamCaches:
        if len(items) == 1:
            return items[0]
        first = items[0]
        return StreamCaches(
            torch.cat([c.embed for c in items]),
            [[[torch.cat([c.layers[s][j][k] for c in items]) for k in range(len(layer))]
              for j, layer in enumerate(stack)] for s, stack in enumerate(first.layers)],
            torch.cat([c.processed for c in items]),
        )  # fmt: skip


# -- heads ----------------------------------------------------------------------------------------------


def context_conv(emb: torch.Tensor, conv: nn.Conv1d) -> torch.Tensor:
    """The stateless decoder's grouped convolution over its whole context, as one contraction:
    ``emb`` (N, context_size, D) -> (N, D), equal to ``conv(emb.transpose(1, 2))[:, :, 0]``.

    Why not ``conv`` itself: with a kernel as long as its input, cuDNN picks FFT algorithms (about
    ten kernels a call) for this tiny convolution, and the transducer search calls it once per
    emitted symbol: on the H200 it was 0.69 s of a 0.81 s offline batch (64 x 30 s)."""
    n, k, d = emb.shape
    w = conv.weight  # (D, D / groups, K)
    per_group = w.shape[1]
    groups = d // per_group
    # out[n, g, o] = sum_{k, i} w[g, o, i, k] * emb[n, k, g, i]
    return torch.einsum("nkgi,goik->ngo", emb.reshape(n, k, groups, per_group),
                        w.reshape(groups, per_group, per_group, k)).reshape(n, d)  # fmt: skip


class Decoder(nn.Module):
    """icefall's stateless prediction network: embedding (negative ids embed to zero), a grouped
    convolution over the last ``context_size`` tokens, ReLU."""

    def __init__(self, cfg: ZipformerConfig) -> None:
        super().__init__()
        self.context_size = cfg.context_size
        self.embedding = Embedding(cfg.vocab_size, cfg.decoder_dim)
        if cfg.context_size > 1:
            self.conv = nn.Conv1d(cfg.decoder_dim, cfg.decoder_dim, cfg.context_size,
                                  groups=cfg.decoder_dim // 4, bias=False)  # fmt: skip

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        """context (N, context_size) -> (N, decoder_dim)."""
        emb = self.embedding(context.clamp(min=0)) * (context >= 0).unsqueeze(-1).to(self.embedding.weight.dtype)
        if self.context_size == 1:
            return emb[:, 0]
        return torch.relu(context_conv(emb, self.conv))


class Joiner(nn.Module):
    def __init__(self, cfg: ZipformerConfig) -> None:
        super().__init__()
        self.encoder_proj = Linear(cfg.output_dim, cfg.joiner_dim)
        self.decoder_proj = Linear(cfg.decoder_dim, cfg.joiner_dim)
        self.output_linear = Linear(cfg.joiner_dim, cfg.vocab_size)

    def forward(self, enc_projected: torch.Tensor, dec_projected: torch.Tensor) -> torch.Tensor:
        return self.output_linear(torch.tanh(enc_projected + dec_projected))


class IcefallNet(nn.Module):
    """The whole model, icefall's ``AsrModel`` parameter names (training-only projections
    ``simple_am_proj`` / ``simple_lm_proj`` and the attention decoder are not kept)."""

    #: linears W8A8 quantization leaves in the model dtype (docs/quantization.md): the
    #: subsampling's output projection, the joiner and the CTC head
    quantization_keep = ("encoder_embed.out", "joiner.*", "ctc_output.*")

    def __init__(self, cfg: ZipformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder_embed = Conv2dSubsampling(cfg)
        self.encoder = Zipformer(cfg)
        if cfg.use_transducer:
            self.decoder = Decoder(cfg)
            self.joiner = Joiner(cfg)
        if cfg.use_ctc:
            self.ctc_output = nn.ModuleDict({"1": Linear(cfg.output_dim, cfg.vocab_size)})

    @property
    def device(self) -> torch.device:
        return self.encoder_embed.out.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.encoder_embed.out.weight.dtype

    def encode(self, feats: torch.Tensor, lengths: torch.Tensor, chunk_size: int = -1,
               left_context_frames: int = -1, uniform: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(B, T, F) fbank -> (B, T', D) encoder output at 25 Hz and its lengths. ``uniform``:
        every row is ``T`` frames long (no padding masks needed; the host knows it)."""
        x, lens = self.encoder_embed(feats, lengths, uniform)
        return self.encoder(x, lens, chunk_size, left_context_frames, uniform)

    def initial_state(self, batch: int, left_context_frames: int) -> StreamCaches:
        dev, dt = self.device, self.dtype
        return StreamCaches(
            embed=self.encoder_embed.initial_cache(batch, dev, dt),
            layers=self.encoder.initial_caches(batch, left_context_frames, dev, dt),
            processed=torch.zeros(batch, dtype=torch.long, device=dev),
        )

    def streaming_forward(self, feats: torch.Tensor, caches: StreamCaches, left_context_frames: int
                          ) -> tuple[torch.Tensor, StreamCaches]:  # fmt: skip
        """One chunk of every row: feats (B, 2 * chunk + 13, F) -> (B, chunk // 2, D) and the
        new caches (icefall's streaming_forward; ``chunk`` at the 50 Hz embed rate)."""
        x, embed = self.encoder_embed.streaming_forward(feats, caches.embed)
        out, layers = self.encoder.streaming_forward(x, caches.layers, left_context_frames, caches.processed)
        return out, StreamCaches(embed, layers, caches.processed + x.shape[1])

    def ctc_log_probs(self, enc: torch.Tensor) -> torch.Tensor:
        return self.ctc_output["1"](enc).float().log_softmax(dim=-1)


IGNORED_PREFIXES = ("simple_am_proj.", "simple_lm_proj.", "attention_decoder.")

__all__ = ["IGNORED_PREFIXES", "LOG_EPS", "IcefallNet", "StreamCaches", "ZipformerConfig", "swoosh_l", "swoosh_r"]

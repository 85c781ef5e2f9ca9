"""The FastConformer network on ``oasr.layers``: dw-striding subsampling, Conformer layers with
Transformer-XL relative-position attention, and the CTC head or the transducer (LSTM prediction
network + joint, TDT durations included).

Parameter names are those ``transformers`` writes for ``ParakeetForCTC`` / ``ParakeetForRNNT`` /
``ParakeetForTDT`` (``encoder.subsampling.layers.N``, ``encoder.layers.N.self_attn.q_proj``,
``ctc_head``, ``encoder_projector``, ``decoder.embedding``, ``decoder.decoder_projector``,
``joint.head``), except three reshapes :func:`to_oasr_state` applies: the 1x1 convolutions
(``pointwise_conv1/2``, ``ctc_head``) are :class:`~oasr.layers.Linear` (their last axis of size
one dropped), and the prediction network's ``nn.LSTM`` layers are :class:`LSTMCell` s
(``decoder.lstm.weight_ih_l0`` -> ``decoder.lstm.0.weight_ih``). NeMo's own names (a ``.nemo``
archive) and the Nemotron streaming layout are renamed to these first (:func:`rename_nemo`,
:func:`rename_nemotron`).

Attention (per head, ``d_k`` = head size): ``softmax(((q + u) k^T + rel_shift((q + v) P^T)) /
sqrt(d_k))`` where ``P`` projects the sinusoidal table of relative distances ``T-1 .. -(T-1)``
(sin/cos interleaved), ``rel_shift`` picks distance ``i - j`` for query ``i`` and key ``j``; the
positional term is handed to the ``attention`` op as its additive mask. The attention context may
be limited: ``regular`` style (``i - left <= j <= i + right``) or NeMo's ``chunked_limited``
(chunks of ``right + 1`` frames see their own chunk and ``left // (right + 1)`` chunks before it).
A long input can be encoded with a local window instead of full attention
(:meth:`FastConformerEncoder.forward` ``local_window``): query blocks attend to their window of
keys only, so memory grows linearly with the length (NeMo's ``rel_pos_local_attn``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oasr.errors import CheckpointError
from oasr.layers import Embedding, LayerNorm, Linear, attention, position_bias
from oasr.layers.conformer import BatchNorm1d, DepthwiseConv1d, glu, swish
from oasr.layers.recurrent import LSTMCell
from oasr_models_nemo.config import NemoConfig


def _neg(dtype: torch.dtype) -> float:
    """The additive value of a masked score: finite (a fully masked padded row stays finite, so
    nothing NaN reaches a valid row through a zero attention weight) and safe in float16."""
    return -1e4 if dtype == torch.float16 else -1e30


def _act(name: str):
    if name in ("silu", "swish"):
        return swish
    if name == "relu":
        return F.relu
    if name == "gelu":
        return F.gelu
    if name == "tanh":
        return torch.tanh
    raise CheckpointError(f"activation {name!r} is not supported")


# -- subsampling ------------------------------------------------------------------------------------


class Conv2dLayer(nn.Module):
    """A 2-D convolution (optionally grouped) whose padding the caller applies."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1) -> None:
        super().__init__()
        self.stride, self.groups, self.kernel = stride, groups, kernel
        self.weight = nn.Parameter(torch.empty(cout, cin // groups, kernel, kernel))
        self.bias = nn.Parameter(torch.zeros(cout))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, stride=self.stride, groups=self.groups)


_FUSED_CONV_RELU = [True]  # cleared for the process when cuDNN refuses the fused form


def _conv2d(h: torch.Tensor, layer: Conv2dLayer, pad: int, relu: bool) -> tuple[torch.Tensor, bool]:
    """``layer``'s convolution of ``h`` (zero padding ``pad`` on both axes); with ``relu`` on
    CUDA, cuDNN's fused convolution + bias + ReLU (one pass over the output, which for the
    first layer is 3 GB at 128 x 30 s: 35 -> 24 ms for the whole subsampling on an H200).
    Returns the output and whether the ReLU is applied."""
    if relu and h.is_cuda and _FUSED_CONV_RELU[0]:
        try:
            return torch.cudnn_convolution_relu(
                h, layer.weight, layer.bias, (layer.stride,) * 2, (pad,) * 2, (1, 1),
                layer.groups), True
        except RuntimeError:
            _FUSED_CONV_RELU[0] = False
    return F.conv2d(h, layer.weight, layer.bias, stride=layer.stride, padding=pad,
                    groups=layer.groups), False


class Subsampling(nn.Module):
    """FastConformer's ``dw_striding``: Conv2d(1 -> C, stride 2), ReLU, then (depthwise Conv2d
    stride 2, pointwise Conv2d, ReLU) until the factor is reached; flatten (C x freq) and project.
    Offline padding is symmetric (``(k-1)//2``) or, for the causal (streaming) form, ``k-1``
    before and ``s-1`` after on both axes. Frames past each row's length are zeroed after every
    convolution, so a padded batch gives each row its own output."""

    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        ch, k, s = c.subsampling_channels, c.subsampling_kernel, c.subsampling_stride
        n = int(math.log2(c.subsampling_factor))
        layers: list[nn.Module] = [Conv2dLayer(1, ch, k, s), nn.ReLU()]
        for _ in range(n - 1):
            layers += [Conv2dLayer(ch, ch, k, s, groups=ch), Conv2dLayer(ch, ch, 1), nn.ReLU()]
        self.layers = nn.ModuleList(layers)
        self.causal = c.causal
        self.kernel, self.stride, self.num_strided = k, s, n
        self.pad = (k - 1, s - 1) if c.causal else ((k - 1) // 2, (k - 1) // 2)
        freq = c.num_mel_bins
        for _ in range(n):
            freq = (freq + sum(self.pad) - k) // s + 1
        self.linear = Linear(ch * freq, c.hidden_size)

    def out_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        for _ in range(self.num_strided):
            lengths = torch.div(lengths + sum(self.pad) - self.kernel, self.stride,
                                rounding_mode="floor") + 1
        return lengths

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.unsqueeze(1)  # (B, 1, T, F)
        # Frames from the shortest row's end on are zeroed where past their row's end, in place
        # and only there: the first convolution's output is (B, C, T/2, F/2), 3 GB in fp16 for
        # 128 x 30 s, and every pass over it counts (a batch of equal lengths has one such frame)
        shortest = int(lengths.min())
        symmetric = self.pad[0] == self.pad[1]
        layers = list(self.layers)
        fused = False  # whether the last convolution applied the ReLU that follows it
        for i, layer in enumerate(layers):
            if not isinstance(layer, Conv2dLayer):  # a ReLU: in place (the convolution's output)
                if not fused:
                    h = torch.relu_(h)
                continue
            # a ReLU after zeroing frames equals zeroing after the ReLU: fuse it into the conv
            relu = i + 1 < len(layers) and isinstance(layers[i + 1], nn.ReLU)
            pad = 0
            if layer.stride > 1:
                if symmetric:  # the convolution pads (no padded copy of its input)
                    pad = self.pad[0]
                else:
                    h = F.pad(h, (*self.pad, *self.pad))
                lengths = torch.div(lengths + sum(self.pad) - self.kernel, self.stride,
                                    rounding_mode="floor") + 1
                shortest = max(0, (shortest + sum(self.pad) - self.kernel) // self.stride + 1)
            h, fused = _conv2d(h, layer, pad, relu)
            if shortest < h.shape[2]:
                t = torch.arange(shortest, h.shape[2], device=h.device)
                keep = (t[None, :] < lengths[:, None]).to(h.dtype)[:, None, :, None]
                h[:, :, shortest:] *= keep
        b, ch, t, f = h.shape
        return self.linear(h.transpose(1, 2).reshape(b, t, ch * f)), lengths

    def forward_stream(self, x: torch.Tensor, caches: list[torch.Tensor],
                       limits: list[torch.Tensor], starts: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One chunk of the causal form. ``x`` (B, T, F) feature frames; ``caches[l]`` the last
        ``k - s`` input frames of strided layer l, (B, C_in, k - s, F_padded) (zeros for a
        first chunk); ``limits[l]`` (B,): how many of layer l's output frames of this chunk are
        valid (frames past the utterance end are zeroed, as offline). ``starts[l]`` (B,): layer
        l's output frames before it are zeroed too (a first chunk left-padded with zero frames
        to a later chunk's size: with zero caches it then gives the first chunk's frames, see
        ``streaming.py``). Returns the projected frames and the new caches."""
        keep = self.kernel - self.stride
        h = x.unsqueeze(1)
        new_caches = []
        s = 0
        lo, hi = self.pad[:2]
        for layer in self.layers:
            if not isinstance(layer, Conv2dLayer):  # a ReLU, in place (a convolution's output)
                h = torch.relu_(h)
                continue
            if layer.stride > 1:
                # the cache's frames, then the chunk's padded on the frequency axis: one buffer
                b, ch, t, f = h.shape
                joined = h.new_empty(b, ch, keep + t, lo + f + hi)
                joined[:, :, :keep] = caches[s]
                joined[:, :, keep:, lo: lo + f] = h
                joined[:, :, keep:, :lo] = 0.0
                joined[:, :, keep:, lo + f:] = 0.0
                new_caches.append(joined[:, :, joined.shape[2] - keep:])
                h = joined
                limit, start = limits[s], starts[s]
                s += 1
            h = layer(h)
            t = torch.arange(h.shape[2], device=h.device)
            keep_t = (t[None, :] < limit[:, None]) & (t[None, :] >= start[:, None])
            h.mul_(keep_t.to(h.dtype)[:, None, :, None])
        b, ch, t, f = h.shape
        return self.linear(h.transpose(1, 2).reshape(b, t, ch * f)), new_caches


# -- positions and attention --------------------------------------------------------------------------


def rel_pe(high: int, low: int, dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(high - low + 1, dim) sinusoidal embeddings of relative distances ``high, high-1 .. low``,
    sin and cos interleaved (Parakeet's / NeMo's ``RelPositionalEncoding``)."""
    pos = torch.arange(high, low - 1, -1, device=device, dtype=torch.float32)
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    f = pos[:, None] * inv[None, :]
    return torch.stack([f.sin(), f.cos()], dim=-1).reshape(len(pos), dim).to(dtype)


class RelPosAttention(nn.Module):
    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        d, h = c.hidden_size, c.num_heads
        self.heads, self.head_dim = h, d // h
        self.scale = self.head_dim ** -0.5
        self.q_proj = Linear(d, d, bias=c.attention_bias)
        self.k_proj = Linear(d, d, bias=c.attention_bias)
        self.v_proj = Linear(d, d, bias=c.attention_bias)
        self.o_proj = Linear(d, d, bias=c.attention_bias)
        self.relative_k_proj = Linear(d, d, bias=False)
        self.bias_u = nn.Parameter(torch.zeros(h, self.head_dim))
        self.bias_v = nn.Parameter(torch.zeros(h, self.head_dim))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: torch.Tensor, pe: torch.Tensor, mask: torch.Tensor | None,
                k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                kv: KeyValueStore | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` (B, T, D); ``pe`` (2S-1, D) for S = cached + T keys; ``mask`` (B, 1, T, S) bool
        (True: attend) or None; caches (B, H, C, dk), or ``kv``: a store that keeps the new
        keys / values and gives back all S of them. Returns the output and the keys / values
        of all S frames."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim)
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        if kv is not None:
            k, v = kv(k, v)
        elif k_cache is not None:
            k = torch.cat([k_cache, k], dim=2)
            v = torch.cat([v_cache, v], dim=2)
        s = k.shape[2]
        # Transformer-XL's position term (matrix "bd") over distances S-1 .. -(S-1), shifted
        bd = position_bias(q + self.bias_v, self.relative_k_proj(pe).view(-1, self.heads, self.head_dim),
                           self.scale, shift_keys=s, mask=mask, fill=_neg(x.dtype))
        out = attention((q + self.bias_u).transpose(1, 2), k, v, mask=bd, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), k, v

    def forward_local(self, x: torch.Tensor, valid: torch.Tensor, context: tuple[int, int],
                      style: str = "regular", block: int = 256) -> torch.Tensor:
        """Limited-context attention one block of queries at a time (memory linear in the
        length): ``regular`` lets frame i see frames ``i - left .. i + right``;
        ``chunked_limited`` lets a chunk of ``right + 1`` frames see itself and ``left //
        (right + 1)`` chunks before it. ``valid`` (B, T) bool. Equal to the dense masks."""
        b, t, _ = x.shape
        left, right = context
        q = self._heads(self.q_proj(x))
        k = self._heads(self.k_proj(x))
        v = self._heads(self.v_proj(x))
        if style == "chunked_limited":
            chunk = right + 1
            back = left // chunk
            reach = block + (back + 1) * chunk
        else:
            reach = block - 1 + max(left, right)
        pe = rel_pe(reach, -reach, q.shape[1] * q.shape[3], x.device, x.dtype)
        p = self.relative_k_proj(pe).view(1, -1, self.heads, self.head_dim).transpose(1, 2)
        qu, qv = q + self.bias_u[None, :, None], q + self.bias_v[None, :, None]
        outs = []
        for start in range(0, t, block):
            end = min(t, start + block)
            if style == "chunked_limited":
                k0 = max(0, (start // chunk - back) * chunk)
                k1 = min(t, ((end - 1) // chunk + 1) * chunk)
            else:
                k0, k1 = max(0, start - left), min(t, end + right)
            qi = torch.arange(start, end, device=x.device)
            kj = torch.arange(k0, k1, device=x.device)
            dist = qi[:, None] - kj[None, :]  # (Bq, Kw)
            scores = torch.matmul(qv[:, :, start:end], p.transpose(-1, -2))  # (B, H, Bq, 2R+1)
            idx = (reach - dist).clamp(0, 2 * reach).expand(b, self.heads, -1, -1)
            bd = scores.gather(-1, idx) * self.scale
            if style == "chunked_limited":
                behind = torch.div(qi, chunk, rounding_mode="floor")[:, None] - torch.div(
                    kj, chunk, rounding_mode="floor")[None, :]
                ok = (behind >= 0) & (behind <= back)
            else:
                ok = (dist <= left) & (-dist <= right)
            allowed = ok[None, None] & valid[:, None, None, k0:k1]
            bd = bd.masked_fill(~allowed, _neg(bd.dtype))
            outs.append(attention(qu[:, :, start:end], k[:, :, k0:k1], v[:, :, k0:k1], mask=bd,
                                  scale=self.scale))
        out = torch.cat(outs, dim=2)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


# -- convolution module and layer ----------------------------------------------------------------


class ConvModule(nn.Module):
    """Pointwise (GLU) -> depthwise (symmetric, or causal with a left cache) -> BatchNorm or
    LayerNorm -> activation -> pointwise. Frames past each row's length are zeroed before the
    depthwise convolution."""

    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        d, k = c.hidden_size, c.conv_kernel_size
        self.causal = c.causal
        self.left = k - 1 if c.causal else (k - 1) // 2
        self.pointwise_conv1 = Linear(d, 2 * d, bias=c.convolution_bias)
        self.depthwise_conv = DepthwiseConv1d(d, k, padding=0 if c.causal else (k - 1) // 2,
                                              bias=c.convolution_bias)
        self.layer_norm = c.conv_norm == "layer_norm"
        self.norm = LayerNorm(d) if self.layer_norm else BatchNorm1d(d)
        self.pointwise_conv2 = Linear(d, d, bias=c.convolution_bias)
        self.act = _act(c.activation)

    def forward(self, x: torch.Tensor, valid: torch.Tensor | None,
                cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (B, T, D); ``cache`` (B, D, k-1): the causal form's previous frames. Returns
        the output and, for the causal form, the (B, D, k-1 + T) input of the depthwise
        convolution (the caller takes each row's new cache from it)."""
        h = glu(self.pointwise_conv1(x), dim=-1)
        if valid is not None:
            h = h.masked_fill(~valid[..., None], 0.0)
        padded = None
        if self.causal:
            if cache is None:
                cache = h.new_zeros(h.shape[0], h.shape[2], self.left)
            # joined along time in the frames' (B, T, D) memory, which the depthwise
            # convolution reads in place on CUDA (a (B, D, T) join would send it to a slow
            # NCHW kernel: 5.7 of a 46 ms Nemotron step at 384 streams on an H200)
            h = padded = torch.cat([cache.transpose(1, 2), h], dim=1).transpose(1, 2)
        else:
            h = h.transpose(1, 2)
        h = self.depthwise_conv(h)
        if self.layer_norm:
            h = self.norm(h.transpose(1, 2))
        else:
            h = self.norm(h).transpose(1, 2)
        return self.pointwise_conv2(self.act(h)), padded


class FeedForward(nn.Module):
    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        self.linear1 = Linear(c.hidden_size, c.intermediate_size, bias=c.attention_bias)
        self.linear2 = Linear(c.intermediate_size, c.hidden_size, bias=c.attention_bias)
        self.act = _act(c.activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.act(self.linear1(x)))


class KeyValueStore:
    """Where a streaming layer's attention history lives outside the batch (a cache pool):
    called with a chunk's keys and values (B, H, T, dk) it stores them and returns the keys
    and values of the whole window, cache and chunk, (B, H, C + T, dk), oldest first."""

    def __call__(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@dataclass
class LayerCache:
    """One layer's streaming state for a batch: keys / values (B, H, C, dk) and the causal
    convolution's last frames (B, D, k-1); or, with ``kv``, keys / values kept by that store
    (``k`` and ``v`` then unused)."""

    k: torch.Tensor | None
    v: torch.Tensor | None
    conv: torch.Tensor
    kv: KeyValueStore | None = None


class FastConformerLayer(nn.Module):
    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        d = c.hidden_size
        self.feed_forward1 = FeedForward(c)
        self.self_attn = RelPosAttention(c)
        self.conv = ConvModule(c)
        self.feed_forward2 = FeedForward(c)
        self.norm_feed_forward1 = LayerNorm(d)
        self.norm_self_att = LayerNorm(d)
        self.norm_conv = LayerNorm(d)
        self.norm_feed_forward2 = LayerNorm(d)
        self.norm_out = LayerNorm(d)

    def forward(self, x, pe, mask, valid, *, local: tuple[tuple[int, int], str] | None = None,
                cache: LayerCache | None = None):
        x = torch.add(x, self.feed_forward1(self.norm_feed_forward1(x)), alpha=0.5)
        h = self.norm_self_att(x)
        k = v = conv_in = None
        if local is not None:
            x = x + self.self_attn.forward_local(h, valid, *local)
        else:
            a, k, v = self.self_attn(h, pe, mask, None if cache is None else cache.k,
                                     None if cache is None else cache.v, None if cache is None else cache.kv)
            x = x + a
        c, conv_in = self.conv(self.norm_conv(x), valid, None if cache is None else cache.conv)
        x = x + c
        x = torch.add(x, self.feed_forward2(self.norm_feed_forward2(x)), alpha=0.5)
        return self.norm_out(x), k, v, conv_in


def context_mask(t_q: int, t_k: int, offset: int, context: tuple[int, int], style: str,
                 device: torch.device) -> torch.Tensor | None:
    """(t_q, t_k) bool: may query i (absolute frame ``offset + i``) see key j (absolute frame j
    of the keys)? None when the context is unlimited."""
    left, right = context
    if left < 0 and right < 0:
        return None
    qi = torch.arange(t_q, device=device)[:, None] + offset
    kj = torch.arange(t_k, device=device)[None, :]
    if style == "chunked_limited":
        chunk = right + 1
        diff = torch.div(qi, chunk, rounding_mode="floor") - torch.div(kj, chunk,
                                                                       rounding_mode="floor")
        left_chunks = left // chunk if left >= 0 else 10_000
        return (diff >= 0) & (diff <= left_chunks)
    ok = torch.ones(t_q, t_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= kj >= qi - left
    if right >= 0:
        ok &= kj <= qi + right
    return ok


class FastConformerEncoder(nn.Module):
    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        self.config = c
        self.subsampling = Subsampling(c)
        self.layers = nn.ModuleList(FastConformerLayer(c) for _ in range(c.num_layers))
        self.input_scale = math.sqrt(c.hidden_size) if c.scale_input else 1.0

    #: longest input (encoder frames) a limited-context model encodes with a dense mask; longer
    #: ones go block-wise (the same result, memory linear in the length)
    dense_limit = 2048

    def forward(self, feats: torch.Tensor, lengths: torch.Tensor, *, local_window: int = 0,
                att_context: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, F) features -> (B, T', D) encoder frames and their lengths. ``att_context``
        defaults to the model's; ``local_window > 0`` gives a full-context model local
        attention of that many frames each side (block-wise)."""
        c = self.config
        x, lengths = self.subsampling(feats, lengths)
        if self.input_scale != 1.0:  # (a pass over the frames saved when it is 1)
            x = x * self.input_scale
        b, t, _ = x.shape
        valid = torch.arange(t, device=x.device)[None, :] < lengths[:, None]
        context = att_context or c.att_context
        style = c.att_context_style
        if context == (-1, -1) and local_window > 0:
            context, style = (local_window, local_window), "regular"
        limited = context != (-1, -1)
        local = (context, style) if limited and (local_window > 0 or t > self.dense_limit) else None
        mask = pe = None
        full = False
        if local is None:
            pe = rel_pe(t - 1, -(t - 1), c.hidden_size, x.device, x.dtype)
            ctx = context_mask(t, t, 0, context, style, x.device)
            full = int(lengths.min()) == t  # no padding: no padding mask (one pass fewer)
            if not full:
                mask = valid[:, None, None, :] & valid[:, None, :, None]
            if ctx is not None:
                mask = ctx[None, None] if mask is None else mask & ctx[None, None]
        for layer in self.layers:
            x = layer(x, pe, mask, None if full else valid, local=local)[0]
        return x, lengths

    def forward_stream(self, x: torch.Tensor, valid: torch.Tensor, key_valid: torch.Tensor,
                       caches: list[LayerCache], right: int
                       ) -> tuple[torch.Tensor, list[LayerCache]]:
        """The Conformer layers over one chunk of subsampled frames ``x`` (B, T, D) of streams
        whose key / value caches are right-aligned to a common length C (``key_valid`` (B, C + T)
        marks real keys: each stream's own cache and the chunk's valid frames, ``valid`` (B, T);
        the caches are in ``caches`` or behind their :class:`KeyValueStore`).
        The chunk starts at a multiple of the chunk size ``right + 1`` in every stream, so one
        chunked-limited mask serves them all. Returns the output and each layer's keys / values
        over all C + T frames (None where a store keeps them) and causal-convolution input (the
        caller trims them)."""
        c = self.config
        if self.input_scale != 1.0:  # (a pass over the frames saved when it is 1)
            x = x * self.input_scale
        b, t, _ = x.shape
        s = key_valid.shape[1]
        cached = s - t
        pe = rel_pe(s - 1, -(s - 1), c.hidden_size, x.device, x.dtype)
        chunk = right + 1
        left = c.att_context[0]
        rel = torch.arange(s, device=x.device) - cached  # key position from the chunk start
        back = -torch.div(rel, chunk, rounding_mode="floor")  # chunks behind the query's
        allowed = (back >= 0) & (back <= (left // chunk if left >= 0 else 10_000))
        mask = (allowed[None, :] & key_valid)[:, None, None, :].expand(b, 1, t, s)
        out = []
        for layer, cache in zip(self.layers, caches, strict=True):
            x, k, v, conv_in = layer(x, pe, mask, valid, cache=cache)
            if cache.kv is not None:  # the store has them: the window is not kept past its layer
                k = v = None
            out.append(LayerCache(k, v, conv_in))
        return x, out


# -- heads ----------------------------------------------------------------------------------------


class PredictionNetwork(nn.Module):
    """Embedding -> stacked LSTM -> projection (NeMo's ``RNNTDecoder`` + the joint's ``pred``)."""

    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        h = c.decoder_hidden_size
        self.embedding = Embedding(c.vocab_size, h)
        self.lstm = nn.ModuleList(LSTMCell(h, h) for _ in range(c.num_decoder_layers))
        self.decoder_projector = Linear(h, h)

    def forward(self, tokens: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        x = self.embedding(tokens)
        hs, cs = [], []
        for i, cell in enumerate(self.lstm):
            h, c = cell(x, state[0][i], state[1][i])
            hs.append(h)
            cs.append(c)
            x = h
        return self.decoder_projector(x), (torch.stack(hs), torch.stack(cs))


class Joint(nn.Module):
    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        self.head = Linear(c.decoder_hidden_size, c.vocab_size + len(c.durations))
        self.act = _act(c.joint_activation)

    def forward(self, enc: torch.Tensor, dec: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(enc + dec))


class FastConformerNet(nn.Module):
    """Encoder + head. CTC: ``ctc_head``; transducer: ``encoder_projector``, ``decoder``,
    ``joint``."""

    #: kept in the model dtype under quantization: the subsampling output, the CTC head and
    #: the joint network with the projections into it
    quantization_keep = ("encoder.subsampling.linear", "ctc_head", "encoder_projector",
                         "decoder.decoder_projector", "joint.*")

    def __init__(self, c: NemoConfig) -> None:
        super().__init__()
        self.config = c
        self.encoder = FastConformerEncoder(c)
        if c.head == "ctc":
            self.ctc_head = Linear(c.hidden_size, c.vocab_size)
        else:
            self.encoder_projector = Linear(c.hidden_size, c.decoder_hidden_size)
            self.decoder = PredictionNetwork(c)
            self.joint = Joint(c)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class NemoTransducerNetwork:
    """The :class:`oasr.decoders.transducer.TransducerNetwork` of a loaded model: state
    ``(h, c)`` of shape (layers, N, hidden); ``join`` takes projected encoder frames."""

    def __init__(self, net: FastConformerNet) -> None:
        self.net = net

    def initial_state(self, batch_size: int, device):
        c = self.net.config
        z = torch.zeros(c.num_decoder_layers, batch_size, c.decoder_hidden_size, device=device,
                        dtype=self.net.dtype)
        return (z, z.clone())

    def predict(self, tokens, state):
        return self.net.decoder(tokens, state)

    def select_state(self, state, index):
        return (state[0][:, index], state[1][:, index])

    def merge_state(self, state, new_state, update):
        m = update.view(1, -1, 1)
        return (torch.where(m, new_state[0], state[0]), torch.where(m, new_state[1], state[1]))

    def join(self, encoder_frames, decoder_out):
        return self.net.joint(encoder_frames, decoder_out)


# -- state dicts ----------------------------------------------------------------------------------

_NEMO_RENAMES = [
    (r"^encoder\.pre_encode\.conv\.", "encoder.subsampling.layers."),
    (r"^encoder\.pre_encode\.out\.", "encoder.subsampling.linear."),
    (r"\.self_attn\.linear_q\.", ".self_attn.q_proj."),
    (r"\.self_attn\.linear_k\.", ".self_attn.k_proj."),
    (r"\.self_attn\.linear_v\.", ".self_attn.v_proj."),
    (r"\.self_attn\.linear_out\.", ".self_attn.o_proj."),
    (r"\.self_attn\.linear_pos\.", ".self_attn.relative_k_proj."),
    (r"\.self_attn\.pos_bias_u$", ".self_attn.bias_u"),
    (r"\.self_attn\.pos_bias_v$", ".self_attn.bias_v"),
    (r"\.conv\.batch_norm\.", ".conv.norm."),
    (r"^decoder\.decoder_layers\.0\.", "ctc_head."),
    (r"^decoder\.prediction\.embed\.", "decoder.embedding."),
    (r"^decoder\.prediction\.dec_rnn\.lstm\.", "decoder.lstm."),
    (r"^joint\.pred\.", "decoder.decoder_projector."),
    (r"^joint\.enc\.", "encoder_projector."),
    (r"^joint\.joint_net\.2\.", "joint.head."),
]


def rename_nemo(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NeMo's parameter names -> the Hugging Face layout's (preprocessor buffers dropped)."""
    out = {}
    for key, value in state.items():
        if key.startswith("preprocessor."):
            continue
        for pattern, repl in _NEMO_RENAMES:
            key = re.sub(pattern, repl, key)
        out[key] = value
    return out


def rename_nemotron(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``NemotronAsrStreamingForRNNT``'s subsampling names -> Parakeet's indices."""
    out = {}
    for key, value in state.items():
        key = key.replace("encoder.subsampling.conv_in.", "encoder.subsampling.layers.0.")
        m = re.match(r"^encoder\.subsampling\.layers\.(\d+)\.(depthwise|pointwise)_conv\.(.*)$", key)
        if m:
            index = 2 + 3 * int(m.group(1)) + (m.group(2) == "pointwise")
            key = f"encoder.subsampling.layers.{index}.{m.group(3)}"
        out[key] = value
    return out


def to_oasr_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face layout -> this module's: 1x1 convolutions as linear weights, nn.LSTM layers
    as LSTM cells."""
    out = {}
    for key, value in state.items():
        if (key.endswith(("pointwise_conv1.weight", "pointwise_conv2.weight"))
                or key == "ctc_head.weight") and value.dim() == 3:
            value = value[..., 0]
        m = re.match(r"^decoder\.lstm\.(weight|bias)_(ih|hh)_l(\d+)$", key)
        if m:
            key = f"decoder.lstm.{m.group(3)}.{m.group(1)}_{m.group(2)}"
        out[key] = value
    return out


def build_network(c: NemoConfig, state: dict[str, torch.Tensor], device: str | torch.device,
                  dtype: torch.dtype | None) -> FastConformerNet:
    """The network with ``state`` (OASR names) loaded strictly; a mismatch lists the tensors."""
    with torch.device("meta"):
        net = FastConformerNet(c)
    expected = net.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        def some(keys: list[str]) -> str:
            return ", ".join(keys[:6]) + (f" (+{len(keys) - 6} more)" if len(keys) > 6 else "")
        parts = []
        if missing:
            parts.append(f"missing {some(missing)}")
        if unexpected:
            parts.append(f"unexpected {some(unexpected)}")
        if wrong:
            parts.append("misshapen " + some([f"{k} {tuple(state[k].shape)} != "
                                              f"{tuple(expected[k].shape)}" for k in wrong]))
        raise CheckpointError("the weights do not match the config: " + "; ".join(parts))
    dev = torch.device(device)
    if dtype is None:
        from oasr.layers import default_dtype

        dtype = default_dtype(dev)
    net.load_state_dict(state, strict=True, assign=True)
    net = net.to(device=dev)
    # float tensors in the compute dtype; BatchNorm's counter stays an integer
    for module in net.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(p.detach().to(dtype), requires_grad=False))
        for name, buf in list(module.named_buffers(recurse=False)):
            if buf.is_floating_point():
                setattr(module, name, buf.to(dtype))
    return net.eval()

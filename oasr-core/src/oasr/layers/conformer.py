"""Conformer building blocks: relative-position self-attention (``pos_bias_u`` / ``pos_bias_v``),
the sinusoidal relative-position table, Conv2d subsampling (x4 / x6 / x8), the Conformer
convolution module (causal or centred depthwise convolution, BatchNorm or LayerNorm, GLU) and the
position-wise feed-forward block.

The attention is the ESPnet / WeNet ``rel_pos`` variant used by U2/U2++ checkpoints: scores are
``((q + u) k^T + (q + v) p^T) / sqrt(d_k)`` where ``p = W_pos pe(key position)`` and **no
rel-shift** is applied, so a key's positional term depends only on its absolute position. That is
what makes chunk-by-chunk streaming with a K/V cache equal to the chunk-masked offline pass.

Overridable ops declared here: ``conv2d``, ``depthwise_conv1d``, ``glu``, ``swish``,
``batch_norm`` (module ops get the module first; see :mod:`oasr.layers._dispatch`). The core of
the attention goes through the existing ``attention`` op with the positional term as an additive
mask.

Streaming conventions (all batched, one row per stream):

* attention: ``cache=(k, v)`` of shape (B, H, Tc, D) is prepended to this call's keys/values; the
  caller passes a bool ``mask`` (B, T, Tc + T) (True = may attend) and positional embeddings
  ``pos_emb`` (B or 1, Tc + T, d) for exactly those keys. The call returns the full (k, v).
* convolution module: ``cache`` (B, C, lorder) holds the last ``kernel - 1`` inputs of a causal
  depthwise convolution; ``lengths`` (B,) lets rows of different valid lengths share one call
  (the returned cache ends at each row's last valid frame).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op, get_override
from oasr.layers.attention import attention, position_bias
from oasr.layers.basic import Conv1d, LayerNorm, Linear, Op
from oasr.layers.fused import glu_depthwise_conv1d

__all__ = [
    "BatchNorm1d",
    "Conv2d",
    "Conv2dSubsampling",
    "ConformerConvModule",
    "DepthwiseConv1d",
    "PositionwiseFeedForward",
    "RelPositionMultiHeadAttention",
    "RelPositionalEncoding",
    "glu",
    "swish",
    "rel_position_table",
]

# -- activations ----------------------------------------------------------------------------------

_SWISH = declare_op("swish")
_GLU = declare_op("glu")


def _swish_native(x: torch.Tensor) -> torch.Tensor:
    return F.silu(x)


def swish(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)`` (SiLU). Overridable op ``"swish"``."""
    return call_op(_SWISH, x.device.type, _swish_native, x)


def _glu_native(x: torch.Tensor, dim: int) -> torch.Tensor:
    return F.glu(x, dim=dim)


def glu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Gated linear unit: first half * sigmoid(second half) along ``dim``. Op ``"glu"``."""
    return call_op(_GLU, x.device.type, _glu_native, x, dim)


ACTIVATIONS = {
    "swish": swish,
    "silu": swish,
    "relu": F.relu,
    "gelu": F.gelu,
    "tanh": torch.tanh,
    "hardtanh": F.hardtanh,
}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


# -- convolutions and norms -----------------------------------------------------------------------


class Conv2d(Op):
    """2-D convolution over (B, C_in, H, W), no padding. Op ``"conv2d"``."""

    op_name: ClassVar[str] = declare_op("conv2d")

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.in_channels, self.out_channels = cin, cout
        self.kernel_size, self.stride = kernel_size, stride
        self.weight = nn.Parameter(torch.empty(cout, cin, kernel_size, kernel_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(cout, device=device, dtype=dtype)) if bias else None
        if not self.weight.is_meta:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight, self.bias, stride=self.stride)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}"


class DepthwiseConv1d(Op):
    """Depthwise (groups = channels) 1-D convolution over (B, C, T) with symmetric zero padding
    ``padding`` (0 for causal use: the caller prepends the left context). Op
    ``"depthwise_conv1d"``."""

    op_name: ClassVar[str] = declare_op("depthwise_conv1d")

    def __init__(self, channels: int, kernel_size: int, padding: int = 0, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.channels, self.kernel_size, self.padding = channels, kernel_size, padding
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype)) if bias else None
        if not self.weight.is_meta:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.stride(1) == 1 and x.shape[1] > 1:
            # (B, C, T) whose memory is (B, T, C), a transposed frame tensor as the Conformer
            # modules pass it: as a (B, C, 1, T) channels-last image cuDNN's NHWC depthwise
            # kernel reads it in place, where conv1d would first copy it to (B, C, T) (H200,
            # 128 x 376 x 1024 fp16, kernel 9: 0.31 ms against 0.79 ms, the same values). The
            # result keeps the (B, T, C) memory, so the caller's transpose back is free.
            w = self.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            return F.conv2d(x.unsqueeze(2), w, self.bias, padding=(0, self.padding),
                            groups=self.channels).squeeze(2)
        return F.conv1d(x, self.weight, self.bias, padding=self.padding, groups=self.channels)

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.kernel_size}, padding={self.padding}"


class BatchNorm1d(Op):
    """Inference BatchNorm over (B, C, T) with running statistics (the state-dict names of
    ``torch.nn.BatchNorm1d``: weight, bias, running_mean, running_var, num_batches_tracked).
    Op ``"batch_norm"``."""

    op_name: ClassVar[str] = declare_op("batch_norm")

    def __init__(self, channels: int, eps: float = 1e-5, device=None, dtype=None) -> None:
        super().__init__()
        self.channels, self.eps = channels, eps
        self.weight = nn.Parameter(torch.ones(channels, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(channels, device=device, dtype=dtype))
        self.register_buffer("running_mean", torch.zeros(channels, device=device, dtype=dtype))
        self.register_buffer("running_var", torch.ones(channels, device=device, dtype=dtype))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long, device=device))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                            training=False, eps=self.eps)


# -- positions ------------------------------------------------------------------------------------


def rel_position_table(length: int, d_model: int, device=None) -> torch.Tensor:
    """(length, d_model) table ``[sin, cos]`` interleaved (even/odd channels) as ESPnet/WeNet
    build it, in float32 with the same operation order (so values are bit-identical)."""
    pe = torch.zeros(length, d_model)
    position = torch.arange(0, length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model)
    )
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.to(device) if device is not None else pe


class RelPositionalEncoding(nn.Module):
    """Scales inputs by ``sqrt(d_model)`` and serves position embeddings by absolute index.

    The table is a non-persistent buffer grown on demand (checkpoints that carry a ``pe`` buffer
    load without it: it is deterministic)."""

    def __init__(self, d_model: int, max_len: int = 5000) -> None:
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.register_buffer("pe", rel_position_table(max_len, d_model), persistent=False)

    def _ensure(self, n: int) -> None:
        if n > self.pe.shape[0]:
            size = max(n, 2 * self.pe.shape[0])
            self.pe = rel_position_table(size, self.d_model, self.pe.device).to(self.pe.dtype)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.xscale

    def range(self, start: int, length: int) -> torch.Tensor:
        """(1, length, d) embeddings of positions ``start .. start + length - 1``."""
        self._ensure(start + length)
        return self.pe[start : start + length].unsqueeze(0)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        """Embeddings of an integer tensor of positions (any shape); negatives read position 0
        (they only occur at masked keys)."""
        n = int(positions.max().item()) + 1 if positions.numel() else 1
        self._ensure(n)
        return F.embedding(positions.clamp_min(0), self.pe)


# -- attention ------------------------------------------------------------------------------------


class RelPositionMultiHeadAttention(nn.Module):
    """Multi-head self-attention with relative-position bias terms (Transformer-XL ``u``/``v``).

    Parameters: ``linear_q``, ``linear_k``, ``linear_v``, ``linear_out`` (:class:`Linear`),
    ``linear_pos`` (no bias), ``pos_bias_u`` / ``pos_bias_v`` (H, D).
    """

    def __init__(self, d_model: int, num_heads: int, *, query_bias: bool = True,
                 key_bias: bool = True, value_bias: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model {d_model} is not divisible by {num_heads} heads")
        self.d_model, self.h, self.d_k = d_model, num_heads, d_model // num_heads
        kw = {"device": device, "dtype": dtype}
        self.linear_q = Linear(d_model, d_model, bias=query_bias, **kw)
        self.linear_k = Linear(d_model, d_model, bias=key_bias, **kw)
        self.linear_v = Linear(d_model, d_model, bias=value_bias, **kw)
        self.linear_out = Linear(d_model, d_model, bias=query_bias, **kw)
        self.linear_pos = Linear(d_model, d_model, bias=False, **kw)
        self.pos_bias_u = nn.Parameter(torch.zeros(num_heads, self.d_k, **kw))
        self.pos_bias_v = nn.Parameter(torch.zeros(num_heads, self.d_k, **kw))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.d_k)

    def forward(
        self,
        x: torch.Tensor,
        pos_emb: torch.Tensor,
        mask: torch.Tensor | None = None,
        cache: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``x`` (B, T, d); ``pos_emb`` (B or 1, S, d) for the S = Tc + T keys; ``mask`` bool
        (B or 1, T or 1, S), True = may attend; ``cache`` (k, v) each (B, H, Tc, D).
        Returns (output (B, T, d), (k, v) of all S keys)."""
        b, t, _ = x.shape
        q = self._heads(self.linear_q(x))  # (B, T, H, D)
        k = self._heads(self.linear_k(x)).transpose(1, 2)  # (B, H, T, D)
        v = self._heads(self.linear_v(x)).transpose(1, 2)
        if cache is not None and cache[0].shape[2] > 0:
            k = torch.cat([cache[0], k], dim=2)
            v = torch.cat([cache[1], v], dim=2)
        p = self.linear_pos(pos_emb)
        p = p.view(p.shape[0], -1, self.h, self.d_k)  # (B|1, S, H, D)
        q_u = (q + self.pos_bias_u).transpose(1, 2)  # (B, H, T, D)
        scale = 1.0 / math.sqrt(self.d_k)
        if mask is not None:
            # a query row with no visible key (padding rows only) would give NaN; let it see
            # everything instead (its output is discarded by the caller)
            mask = (mask | ~mask.any(dim=-1, keepdim=True)).unsqueeze(1)
        bias = position_bias(q + self.pos_bias_v, p.to(q.dtype), scale, mask=mask)  # (B, H, T, S)
        out = attention(q_u, k, v, bias, False, scale)
        out = out.transpose(1, 2).reshape(b, t, self.d_model)
        return self.linear_out(out), (k, v)


# -- blocks ---------------------------------------------------------------------------------------


class PositionwiseFeedForward(nn.Module):
    """``w_2(act(w_1(x)))`` (the Transformer / Conformer FFN; macaron halves are two of these)."""

    def __init__(self, dim: int, hidden: int, act: str = "swish", bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.w_1 = Linear(dim, hidden, bias=bias, device=device, dtype=dtype)
        self.w_2 = Linear(hidden, dim, bias=bias, device=device, dtype=dtype)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.act(self.w_1(x)))


class ConformerConvModule(nn.Module):
    """pointwise conv (C -> 2C) -> GLU -> depthwise conv (kernel K, causal or centred) -> norm
    (BatchNorm or LayerNorm) -> activation -> pointwise conv (C -> C).

    Parameters: ``pointwise_conv1``, ``depthwise_conv``, ``norm``, ``pointwise_conv2``.
    ``causal=True``: left context of K - 1 frames (``lorder``), zeros at the start of a stream or
    the ``cache`` of the previous chunk."""

    #: device types where an eval-mode BatchNorm is folded into the depthwise convolution (the
    #: GPU, where the norm was a pass over the frames of its own). The CPU keeps the reference's
    #: float32 rounding, which the golden tests compare against WeNet's.
    fold_batch_norm_on: ClassVar[frozenset[str]] = frozenset({"cuda"})

    def __init__(self, channels: int, kernel_size: int = 15, *, causal: bool = False,
                 norm: str = "batch_norm", act: str = "swish", bias: bool = True,
                 norm_eps: float = 1e-5, inner_factor: int = 2, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        inner = inner_factor * channels // 2
        self.channels, self.inner = channels, inner
        self.pointwise_conv1 = Conv1d(channels, 2 * inner, 1, bias=bias, **kw)
        if causal:
            padding, self.lorder = 0, kernel_size - 1
        else:
            if (kernel_size - 1) % 2:
                raise ValueError("a non-causal conformer convolution needs an odd kernel size")
            padding, self.lorder = (kernel_size - 1) // 2, 0
        self.causal = causal
        self.depthwise_conv = DepthwiseConv1d(inner, kernel_size, padding=padding, bias=bias, **kw)
        if norm == "batch_norm":
            self.norm: nn.Module = BatchNorm1d(inner, eps=norm_eps, **kw)
            self.use_layer_norm = False
        elif norm == "layer_norm":
            self.norm = LayerNorm(inner, eps=norm_eps, **kw)
            self.use_layer_norm = True
        else:
            raise ValueError(f"conformer conv norm must be batch_norm or layer_norm, not {norm!r}")
        self.pointwise_conv2 = Conv1d(inner, channels, 1, bias=bias, **kw)
        self.act = activation(act)

    def forward(
        self,
        x: torch.Tensor,
        valid: torch.Tensor | None = None,
        cache: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x`` (B, T, C); ``valid`` (B, T) bool, False frames are zeroed before and after;
        ``cache`` (B, C, lorder) for causal streaming; ``lengths`` (B,) valid frames per row (for
        the returned cache). Returns ((B, T, C), new cache or None)."""
        if valid is not None:
            # masked while still (B, T, C): the (B, C, T) view below then keeps that memory, which
            # the CUDA pointwise convolution reads as one GEMM (Conv1d); masking the view made a
            # contiguous (B, C, T) copy and sent it to cuDNN's slower kernels instead. One pass
            # (masked_fill is a copy and a fill).
            x = torch.where(valid[:, :, None], x, 0.0)
        new_cache = None
        if self.lorder > 0:
            if cache is None or cache.shape[2] == 0:
                cache = x.new_zeros(x.shape[0], x.shape[2], self.lorder)
            # joined in (B, T, C), so the (B, C, T) view keeps frames-major memory (the GEMM and
            # frames-major kernel paths, as without left context)
            x = torch.cat([cache.transpose(1, 2), x], dim=1).transpose(1, 2)
            if lengths is None:
                new_cache = x[:, :, -self.lorder :]
            else:
                idx = lengths.to(x.device)[:, None] + torch.arange(self.lorder, device=x.device)[None, :]
                new_cache = torch.gather(x, 2, idx[:, None, :].expand(-1, x.shape[1], -1))
        else:
            x = x.transpose(1, 2)  # (B, C, T)
        folded = self._folded_depthwise(x.device.type)
        # GLU then the depthwise convolution: one op (one kernel with oasr-kernels on CUDA), with
        # the activation too where the norm is folded away
        if folded is not None and self.act is swish:
            x = glu_depthwise_conv1d(self.pointwise_conv1(x), folded, "swish")
        else:
            x = glu_depthwise_conv1d(self.pointwise_conv1(x), self.depthwise_conv if folded is None else folded)
            if folded is None:
                if self.use_layer_norm:
                    x = self.norm(x.transpose(1, 2)).transpose(1, 2)
                else:
                    x = self.norm(x)
            x = self.act(x)
        x = self.pointwise_conv2(x).transpose(1, 2)  # (B, T, C)
        if valid is not None:
            x = x.masked_fill_(~valid[:, :, None], 0.0)  # in place: the output is ours
        return x, new_cache

    def _folded_depthwise(self, device_type: str) -> DepthwiseConv1d | None:
        """In eval mode with BatchNorm: the depthwise convolution with the norm folded into its
        weight and bias (``w * s``, ``(b - mean) * s + beta``, ``s = gamma / sqrt(var + eps)``),
        the same function with one pass over the frames fewer. Built in float64 (float32 off the
        CPU) once and kept until a parameter changes (load, ``.to()``, in-place edits). None in
        training, with LayerNorm, on devices outside :attr:`fold_batch_norm_on`, or where a
        ``batch_norm`` override should see the call."""
        conv, bn = self.depthwise_conv, self.norm
        if (self.training or device_type not in self.fold_batch_norm_on
                or type(bn) is not BatchNorm1d or type(conv) is not DepthwiseConv1d
                or get_override(BatchNorm1d.op_name, device_type) is not None):  # fmt: skip
            return None
        sources = (conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var)
        stamp = tuple(None if t is None else t._version for t in sources) + (bn.eps,)
        cached = self.__dict__.get("_folded_cache")
        if (cached is not None and cached[2] == stamp
                and all(a is b for a, b in zip(cached[0], sources, strict=True))):  # fmt: skip
            return cached[1]
        wide = torch.float64 if conv.weight.device.type == "cpu" else torch.float32
        with torch.no_grad():
            scale = bn.weight.to(wide) * torch.rsqrt(bn.running_var.to(wide) + bn.eps)
            mean = bn.running_mean.to(wide)
            bias = -mean if conv.bias is None else conv.bias.to(wide) - mean
            folded = DepthwiseConv1d(conv.channels, conv.kernel_size, conv.padding, device="meta")
            dtype = conv.weight.dtype
            weight = (conv.weight.to(wide) * scale[:, None, None]).to(dtype)
            folded.weight = nn.Parameter(weight, requires_grad=False)
            bias = (bias * scale + bn.bias.to(wide)).to(dtype)
            folded.bias = nn.Parameter(bias, requires_grad=False)
        # a plain attribute (a tuple), not a submodule: no state-dict entries, not moved by .to()
        self._folded_cache = (sources, folded, stamp)
        return folded


_SUBSAMPLING = {
    # rate: (conv (kernel, stride) list, right context in input frames)
    4: ([(3, 2), (3, 2)], 6),
    6: ([(3, 2), (5, 3)], 10),
    8: ([(3, 2), (3, 2), (3, 2)], 14),
}


class Conv2dSubsampling(nn.Module):
    """Conv2d front end: (B, T, F) features -> (B, T', d) with T' ~ T / rate, rate 4, 6 or 8
    (ReLU after every convolution, then a linear layer over channels x frequency).

    Parameters: ``conv.{i}`` (:class:`Conv2d`), ``out`` (:class:`Linear`). ``right_context``:
    input frames beyond the first needed for one output frame (6 / 10 / 14)."""

    def __init__(self, in_dim: int, out_dim: int, rate: int = 4, device=None, dtype=None) -> None:
        super().__init__()
        if rate not in _SUBSAMPLING:
            raise ValueError(f"conv2d subsampling rate must be 4, 6 or 8, not {rate}")
        layers, self.right_context = _SUBSAMPLING[rate]
        self.rate = rate
        self.layers = layers
        convs = []
        cin = 1
        f = in_dim
        for k, s in layers:
            convs.append(Conv2d(cin, out_dim, k, s, device=device, dtype=dtype))
            cin = out_dim
            f = (f - k) // s + 1
        self.conv = nn.ModuleList(convs)
        self.out = Linear(out_dim * f, out_dim, device=device, dtype=dtype)

    def output_length(self, n: torch.Tensor | int) -> torch.Tensor | int:
        """Output frames for ``n`` input frames (0 when too short)."""
        for k, s in self.layers:
            n = (n - k) // s + 1
        if isinstance(n, torch.Tensor):
            return n.clamp_min(0)
        return max(0, n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and self._frames_last_ok(x):
            return self.forward_frames_last(x)
        x = x.unsqueeze(1)  # (B, 1, T, F)
        for conv in self.conv:
            x = torch.relu_(conv(x))  # in place: the convolution's output is ours
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))

    def _frames_last_ok(self, x: torch.Tensor) -> bool:
        k = self.layers[0][0]
        return (x.dim() == 3 and x.shape[1] >= k and x.shape[2] >= k
                and all(type(c) is Conv2d for c in self.conv)
                and get_override(Conv2d.op_name, x.device.type) is None)  # fmt: skip

    def forward_frames_last(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with the activations kept (B, T, F, C), channels innermost (what CUDA
        takes; any device computes the same function). The first convolution has one input
        channel: it is a GEMM of the (B, T', F', k*k) input windows with the (C, k*k) kernels,
        bias and ReLU in its epilogue, so its large output is written once (cuDNN converted it
        between layouts and added the bias and the ReLU in passes of their own). The later ones
        are cuDNN convolutions of that memory as a channels-last image, with no layout
        conversion; the last one's bias is added while its output is laid out (B, T, C, F) for
        the projection."""
        first = self.conv[0]
        k, s, c = first.kernel_size, first.stride, first.out_channels
        # (B, T', F', k, k) windows: [b, t, f, i, j] = x[b, s t + i, s f + j]
        win = x.unfold(1, k, s).unfold(2, k, s)
        taps = k * k
        width = -(-taps // 8) * 8  # zeros to whole 16-byte rows (the tensor-core GEMMs)
        cols = x.new_zeros(*win.shape[:3], width)
        cols[..., :taps].unflatten(-1, (k, k)).copy_(win)
        w = x.new_zeros(c, width)
        w[:, :taps] = first.weight.reshape(c, taps)
        rows = cols.view(-1, width)
        if first.bias is None:
            h = torch.relu_(rows @ w.t())
        else:
            # bias and ReLU in the GEMM's epilogue (cuBLASLt on CUDA): its output written once
            h = torch._addmm_activation(first.bias, rows, w.t())
        h = h.view(*win.shape[:3], c)  # (B, T', F', C)
        for i, conv in enumerate(self.conv[1:], 2):
            weight = conv.weight.contiguous(memory_format=torch.channels_last)
            # (B, C, T, F) view of the frames-last memory: a channels-last image
            h = F.conv2d(h.permute(0, 3, 1, 2), weight, None, stride=conv.stride)
            h = h.permute(0, 2, 3, 1)
            if i < len(self.conv):
                h = torch.relu_(h if conv.bias is None else h.add_(conv.bias))
        b, t, f, c = h.shape
        bias = self.conv[-1].bias if len(self.conv) > 1 else None  # still to add
        grad = torch.is_grad_enabled() and (h.requires_grad or getattr(bias, "requires_grad", False))
        if len(self.conv) == 1:
            out = h.transpose(2, 3).contiguous()
        elif bias is None:
            out = torch.relu_(h.transpose(2, 3).contiguous())
        elif grad:  # out= takes no autograd
            out = torch.relu(h.transpose(2, 3) + bias[:, None]).contiguous()
        else:
            out = torch.empty(b, t, c, f, dtype=h.dtype, device=h.device)
            torch.relu_(torch.add(h.transpose(2, 3), bias[:, None], out=out))
        return self.out(out.view(b, t, c * f))

"""Elementwise / dense ops: Linear, LayerNorm, Conv1d, Embedding, GELU MLP, sinusoids."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op


class Op(nn.Module):
    """Base of overridable module ops. Subclasses set ``op_name`` and implement
    ``forward_native(*args)``; ``forward`` dispatches on the device type of the first argument."""

    op_name: ClassVar[str] = ""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return call_op(self.op_name, x.device.type, self._native, self, x, *args, **kwargs)

    @staticmethod
    def _native(module: Op, *args: Any, **kwargs: Any) -> Any:
        return module.forward_native(*args, **kwargs)

    def forward_native(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


class Linear(Op):
    """``y = x W^T + b``. The class quantization replaces (it keeps ``in_features``,
    ``out_features``, ``weight``, ``bias``), so models must use it for every projection."""

    op_name = declare_op("linear")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.is_meta:  # shapes only (weights are loaded later): skip the init
            return
        bound = 1.0 / math.sqrt(max(1, self.in_features))
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class LayerNorm(Op):
    """LayerNorm over the last dimension, with affine weight and bias."""

    op_name = declare_op("layer_norm")

    def __init__(
        self,
        normalized_shape: int,
        eps: float = 1e-5,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.normalized_shape = (normalized_shape,)
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(normalized_shape, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(normalized_shape, device=device, dtype=dtype))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape[0]}, eps={self.eps}"


class Conv1d(Op):
    """1-D convolution over (B, C_in, T) -> (B, C_out, T')."""

    op_name = declare_op("conv1d")

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size
        self.stride = stride
        self.padding = padding
        self.weight = nn.Parameter(
            torch.empty(out_channels, in_channels, kernel_size, device=device, dtype=dtype)
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_channels, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        if not self.weight.is_meta:
            bound = 1.0 / math.sqrt(max(1, in_channels * kernel_size))
            nn.init.uniform_(self.weight, -bound, bound)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        if (x.is_cuda and self.kernel_size == 1 and self.stride == 1 and self.padding == 0
                and x.dim() == 3 and x.stride(1) == 1):
            # pointwise, on a transposed (B, T, C) frame tensor (how the Conformer convolution
            # modules hold theirs): one GEMM with the bias fused, over the frames as they lie.
            # cuDNN would convert the layout and add the bias in passes of its own (H200, one
            # WeNet convolution module at 64 x 30 s fp16: 0.36 vs 0.62 ms at d=256, 0.53 vs
            # 1.48 ms at d=512, benchmarks/conformer_layouts.py). The result keeps the
            # (B, T, C) memory.
            return F.linear(x.transpose(1, 2), self.weight[:, :, 0], self.bias).transpose(1, 2)
        return F.conv1d(x, self.weight, self.bias, stride=self.stride, padding=self.padding)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}, padding={self.padding}"
        )


class Embedding(Op):
    """Token embedding table; :meth:`unembed` is the tied output projection ``x E^T``."""

    op_name = declare_op("embedding")

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        if not self.weight.is_meta:
            nn.init.normal_(self.weight, std=embedding_dim**-0.5)

    def forward_native(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the vocabulary from hidden states (weight tying), via the linear op."""
        return call_op("linear", x.device.type, _tied_linear_native, _TiedLinear(self.weight), x)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}"


class _TiedLinear:
    """A bias-free linear view of a weight, so ``linear`` overrides see a Linear-like object."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.bias = None
        self.out_features, self.in_features = weight.shape

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _tied_linear_native(module: _TiedLinear, x: torch.Tensor) -> torch.Tensor:
    return module.forward_native(x)


class GELUMLP(nn.Module):
    """Transformer feed-forward block: ``fc2(gelu(fc1(x)))`` with exact (erf) GELU."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden_dim, bias=bias, device=device, dtype=dtype)
        self.fc2 = Linear(hidden_dim, dim, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(gelu(self.fc1(x)))


_GELU = declare_op("gelu")


def _gelu_native(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU (overridable op ``"gelu"``)."""
    return call_op(_GELU, x.device.type, _gelu_native, x)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """Sinusoidal position table (length, channels): ``[sin | cos]`` halves with geometric
    timescales from 1 to ``max_timescale`` (Whisper's encoder positions)."""
    if channels % 2:
        raise ValueError(f"sinusoids need an even number of channels, got {channels}")
    half = channels // 2
    log_increment = math.log(max_timescale) / max(1, half - 1)
    inv_timescales = torch.exp(-log_increment * torch.arange(half, dtype=torch.float64))
    scaled = torch.arange(length, dtype=torch.float64)[:, None] * inv_timescales[None, :]
    return torch.cat([torch.sin(scaled), torch.cos(scaled)], dim=1).to(torch.float32)


class SinusoidalPositionalEmbedding(nn.Module):
    """Adds a fixed sinusoidal table (stored as a persistent buffer ``weight`` so checkpoints
    that carry their own table load into it) to (B, T, C) inputs starting at ``offset``."""

    def __init__(self, length: int, channels: int, max_timescale: float = 10000.0) -> None:
        super().__init__()
        self.register_buffer("weight", sinusoids(length, channels, max_timescale))

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        t = x.shape[-2]
        if offset + t > self.weight.shape[0]:
            raise ValueError(
                f"sequence of {offset + t} positions exceeds the table's {self.weight.shape[0]}"
            )
        return x + self.weight[offset : offset + t].to(x.dtype)

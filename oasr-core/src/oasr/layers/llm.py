"""Pieces of decoder-only language models (Qwen2, Llama-style): RMSNorm, rotary position
embeddings and the gated SiLU feed-forward block.

``RMSNorm`` is an overridable op (``"rms_norm"``); its native code is ``transformers``'
(normalise in float32, cast back, then scale). ``rotary_qk`` (rotary positions on a fused
projection's queries and keys) and ``silu_mul`` (the gated SiLU of a fused gate/up output) are
overridable ops too (oasr-kernels runs each as one kernel on CUDA). Rotary embeddings take absolute positions as a
tensor, so a decode step over a paged cache (positions differ per row) stays capturable in a
CUDA graph: nothing is read back to the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op
from oasr.layers.basic import Linear, Op

__all__ = ["RMSNorm", "RotaryEmbedding", "SiLUGatedMLP", "apply_rotary", "rotary_qk", "silu_mul"]

_ROTARY_QK = declare_op("rotary_qk")
_SILU_MUL = declare_op("silu_mul")


class RMSNorm(Op):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, computed in float32."""

    op_name = declare_op("rms_norm")

    def __init__(self, dim: int, eps: float = 1e-6, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        # one fused kernel where torch has one (a decode step is launch-bound at batch 1)
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (the "default" rope of ``transformers``): ``cos``/``sin``
    (B, T, head_dim) for absolute ``positions`` (B, T), computed in float32."""

    def __init__(self, head_dim: int, theta: float = 10000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def signed_rotary_sin(sin: torch.Tensor) -> torch.Tensor:
    """``sin`` with the first half of its last axis negated: ``rotate_half(x) * sin`` equals
    ``swap_halves(x) * signed_rotary_sin(sin)`` product for product (only a sign moves), so a
    model computes it once per forward instead of negating ``x`` in every layer."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + swap_halves(x) * signed_sin`` over the last axis, any layout (``cos`` and
    ``signed_sin`` broadcast to ``x``): queries and keys may be rotated in one call."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


def _rotary_qk_native(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                      heads: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    b, t = qk.shape[:2]
    qk = apply_rotary_signed(qk, cos, signed_sin)
    return qk[:, :, :heads], qk[:, :, heads:].reshape(b, t, -1)


def rotary_qk(qk: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
              heads: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Rotary positions on the queries and keys of one fused projection: ``qk`` (B, T,
    heads + kv_heads, head_dim) (a view of the q/k/v output, any strides but the last),
    ``cos`` / ``signed_sin`` (B, T, 1, head_dim) (:func:`signed_rotary_sin`; batch or token
    axes of size 1 broadcast). Returns the queries (B, T, heads, head_dim) and the keys
    (B, T, kv_heads * head_dim), ``apply_rotary_signed``'s values. Overridable op
    ``"rotary_qk"`` (oasr-kernels: one kernel instead of four plus the keys' copy)."""
    return call_op(_ROTARY_QK, qk.device.type, _rotary_qk_native, qk, cos, signed_sin, heads)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by ``cos``/``sin`` (B, T, D) (halves rotated, as ``transformers``'
    ``rotate_half``)."""
    return apply_rotary_signed(x, cos[:, None], signed_rotary_sin(sin)[:, None])


class SiLUGatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``, the feed-forward block of Qwen2 / Llama, with the gate
    and up projections in one :class:`Linear` (``gate_up_proj``: the gate's rows, then the up
    projection's; a checkpoint's two weights are concatenated when loading): one GEMM."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.hidden = hidden
        self.gate_up_proj = Linear(dim, 2 * hidden, bias=bias, **kw)
        self.down_proj = Linear(hidden, dim, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_up_proj(x), self.hidden))


def _silu_mul_native(x: torch.Tensor, hidden: int) -> torch.Tensor:
    gate, up = x.split(hidden, dim=-1)
    return F.silu(gate) * up


def silu_mul(x: torch.Tensor, hidden: int) -> torch.Tensor:
    """``silu(gate) * up`` of a fused gate/up projection's output ``x`` (..., 2 * hidden) (the
    gate's columns first). Overridable op ``"silu_mul"`` (oasr-kernels: one pass over ``x``
    instead of two kernels over its strided halves)."""
    return call_op(_SILU_MUL, x.device.type, _silu_mul_native, x, hidden)

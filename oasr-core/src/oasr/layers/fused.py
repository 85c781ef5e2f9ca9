"""Fused functional ops: several native ops in one call, so a kernel provider can run them as
one kernel (``oasr-kernels`` does on CUDA; see ``docs/kernels.md``).

Each op's native implementation is exactly the sequence of ops the models ran before the fused
op existed, through the same modules (a ``layer_norm`` or ``glu`` override still applies to the
native path), so on CPU, and wherever no override takes the call, outputs are unchanged.

Ops (overridable; overrides receive exactly the arguments below):

``add_norm(x, residual, norm)``
    ``s = x + residual`` (``residual`` may be None: ``s = x``); returns ``(s, norm(s))`` for a
    :class:`~oasr.layers.LayerNorm` or :class:`~oasr.layers.RMSNorm` module ``norm``. A
    pre-norm transformer block's residual add and the next block's norm in one pass.
``bias_act(x, bias, act)``
    ``act(x + bias)`` with ``act`` "gelu" (exact erf), "silu" or "swish" (the same function);
    ``bias`` broadcast over the last axis, or None.
``glu_depthwise_conv1d(x, conv[, act])``
    ``conv(glu(x, dim=1))``: the Conformer convolution module's GLU then its depthwise
    convolution (:class:`~oasr.layers.DepthwiseConv1d`), ``x`` (B, 2C, T); with ``act="swish"``
    then ``swish`` of that (the module's activation, where no norm lies between, e.g. a
    BatchNorm folded into the convolution). ``act`` reaches an override only when given.
``log_mel_power(stft, filters, frames)``
    ``log10(clamp(filters @ |stft[..., :frames]|^2, min=1e-10))``: Whisper's log-mel from a
    complex STFT (B, F, T') and mel filters (M, F); (B, M, frames) float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op

__all__ = ["ACTIVATIONS", "add_norm", "bias_act", "glu_depthwise_conv1d", "log_mel_power"]

_ADD_NORM = declare_op("add_norm")
_BIAS_ACT = declare_op("bias_act")
_GLU_DWCONV = declare_op("glu_depthwise_conv1d")
_LOG_MEL_POWER = declare_op("log_mel_power")

#: activations ``bias_act`` takes
ACTIVATIONS = ("gelu", "silu", "swish")


def _add_norm_native(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x if residual is None else x + residual
    return s, norm(s)


def add_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x + residual, norm(x + residual))``. Overridable op ``"add_norm"``."""
    return call_op(_ADD_NORM, x.device.type, _add_norm_native, x, residual, norm)


def _bias_act_native(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    s = x if bias is None else x + bias
    return F.gelu(s) if act == "gelu" else F.silu(s)


def bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str = "gelu") -> torch.Tensor:
    """``act(x + bias)`` ("gelu": exact erf GELU; "silu"/"swish": ``s * sigmoid(s)``).
    Overridable op ``"bias_act"``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"bias_act takes act in {ACTIVATIONS}, not {act!r}")
    return call_op(_BIAS_ACT, x.device.type, _bias_act_native, x, bias, act)


#: activations ``glu_depthwise_conv1d`` takes
DWCONV_ACTIVATIONS = ("swish",)


def _glu_dwconv_native(x: torch.Tensor, conv: nn.Module, act: str | None = None) -> torch.Tensor:
    from oasr.layers.conformer import glu, swish

    y = conv(glu(x, dim=1))
    return y if act is None else swish(y)


def glu_depthwise_conv1d(x: torch.Tensor, conv: nn.Module, act: str | None = None) -> torch.Tensor:
    """``conv(glu(x, dim=1))`` for ``x`` (B, 2C, T) and a depthwise convolution ``conv`` over C
    channels, then ``swish`` when ``act="swish"``. Overridable op ``"glu_depthwise_conv1d"``."""
    if act is None:
        return call_op(_GLU_DWCONV, x.device.type, _glu_dwconv_native, x, conv)
    if act not in DWCONV_ACTIVATIONS:
        raise ValueError(f"glu_depthwise_conv1d takes act in {DWCONV_ACTIVATIONS}, not {act!r}")
    return call_op(_GLU_DWCONV, x.device.type, _glu_dwconv_native, x, conv, act)


def _log_mel_power_native(stft: torch.Tensor, filters: torch.Tensor, frames: int) -> torch.Tensor:
    # contiguous: the strided view sends the matmul down a slow CPU path
    magnitudes = (stft[..., :frames].abs() ** 2).contiguous()
    mel = filters @ magnitudes
    return torch.clamp(mel, min=1e-10).log10()


def log_mel_power(stft: torch.Tensor, filters: torch.Tensor, frames: int) -> torch.Tensor:
    """``log10(clamp(filters @ |stft[..., :frames]|^2, min=1e-10))``: complex ``stft``
    (..., F, T'), ``filters`` (M, F) float32 -> (..., M, frames) float32.
    Overridable op ``"log_mel_power"``."""
    return call_op(_LOG_MEL_POWER, stft.device.type, _log_mel_power_native, stft, filters, frames)

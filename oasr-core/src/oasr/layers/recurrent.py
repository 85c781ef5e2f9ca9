"""Recurrent ops: :class:`LSTMCell` (one step, or a whole sequence with ``forward_sequence``).

Import by module path (``from oasr.layers.recurrent import LSTMCell``). Parameters follow
PyTorch's layout (``weight_ih`` ``(4H, I)``, ``weight_hh`` ``(4H, H)``, ``bias_ih``, ``bias_hh``;
gate order input, forget, cell, output), so PyTorch and TorchScript checkpoints load as they are.

Two overridable ops:

* ``lstm_cell``: ``fn(module, x, h, c) -> (h, c)`` for one step, ``x`` ``(B, I)``;
* ``lstm_sequence``: ``fn(module, x, h, c, mask) -> (y, h, c)`` over ``x`` ``(B, T, I)``, ``y``
  the hidden states ``(B, T, H)``; ``mask`` ``(B, T)`` bool or ``None`` (False: carry the state).

The native sequence path computes the input projection of every step in one matmul and runs only
the hidden-to-hidden product step by step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op

_SEQ_OP = declare_op("lstm_sequence")


class LSTMCell(nn.Module):
    """An LSTM cell: ``h, c = cell(x, h, c)``; zeros when ``h``/``c`` are ``None``."""

    op_name = declare_op("lstm_cell")

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.hidden_size = hidden_size
        kw = {"device": device, "dtype": dtype}
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size, **kw))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size, **kw))
        if bias:
            self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size, **kw))
            self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size, **kw))
        else:
            self.register_parameter("bias_ih", None)
            self.register_parameter("bias_hh", None)
        bound = 1.0 / math.sqrt(hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)

    def zero_state(self, batch: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.zeros(batch, self.hidden_size, device=like.device, dtype=like.dtype)
        return z, z.clone()

    # -- one step ---------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, h: torch.Tensor | None = None, c: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if h is None or c is None:
            h, c = self.zero_state(x.shape[0], x)
        return call_op(self.op_name, x.device.type, _cell_native, self, x, h, c)

    # -- a sequence -------------------------------------------------------------------------
    def forward_sequence(
        self,
        x: torch.Tensor,
        h: torch.Tensor | None = None,
        c: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run over ``x`` ``(B, T, I)``; returns every hidden state ``(B, T, H)`` and the last
        ``h``, ``c``. ``mask`` ``(B, T)`` (bool): where False the step is skipped for that row
        (state carried unchanged), so rows of different lengths batch together."""
        if h is None or c is None:
            h, c = self.zero_state(x.shape[0], x)
        return call_op(_SEQ_OP, x.device.type, _sequence_native, self, x, h, c, mask)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias_ih is not None}"


def _gates_to_state(
    gates: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h, c


def _cell_native(
    m: LSTMCell, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    h2, c2 = torch.lstm_cell(x, (h, c), m.weight_ih, m.weight_hh, m.bias_ih, m.bias_hh)
    return h2, c2


def _sequence_native(
    m: LSTMCell,
    x: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    steps = x.shape[1]
    if steps == 0:
        return x.new_zeros(x.shape[0], 0, m.hidden_size), h, c
    if mask is None and x.is_cuda:
        return _sequence_cudnn(m, x, h, c)
    bias = None
    if m.bias_ih is not None:
        bias = m.bias_ih + m.bias_hh
    xg = F.linear(x, m.weight_ih, bias)  # (B, T, 4H): every step's input projection at once
    outs = []
    for t in range(steps):
        gates = xg[:, t] + F.linear(h, m.weight_hh)
        h_new, c_new = _gates_to_state(gates, c)
        if mask is not None:
            keep = mask[:, t, None]
            h_new = torch.where(keep, h_new, h)
            c_new = torch.where(keep, c_new, c)
        h, c = h_new, c_new
        outs.append(h)
    return torch.stack(outs, dim=1), h, c


def _sequence_cudnn(
    m: LSTMCell, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole sequence in one cuDNN call. On a GPU the step loop above is launch-bound: a
    Silero scan of 64 inputs of 35 s (1100 steps) took 0.1 s of Python there. TF32 stays off
    so the result matches the float32 loop to rounding."""
    params = [m.weight_ih, m.weight_hh]
    if m.bias_ih is not None:
        params += [m.bias_ih, m.bias_hh]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        y, hn, cn = torch.lstm(x.contiguous(), (h[None].contiguous(), c[None].contiguous()), params,
                               m.bias_ih is not None, 1, 0.0, False, False, True)  # fmt: skip
    return y, hn[0], cn[0]


__all__ = ["LSTMCell"]

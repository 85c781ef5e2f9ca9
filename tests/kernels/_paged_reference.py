"""The float64 reference for the paged decode-attention kernel tests (GPU and CPU emulation)."""

from __future__ import annotations

import torch


def reference(q, k_pool, v_pool, tables, lengths, scale=None):
    """Each row's valid keys located one by one, dense attention in float64 on the CPU."""
    q, k_pool, v_pool, tables, lengths = (t.cpu() for t in (q, k_pool, v_pool, tables, lengths))
    b, h, _, d = q.shape
    bs = k_pool.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty(b, h, 1, d, dtype=torch.float64)
    for row in range(b):
        pos = torch.arange(int(lengths[row]))
        slots = tables[row, pos // bs] * bs + pos % bs
        k = k_pool.reshape(-1, h, d)[slots].double().transpose(0, 1)  # (H, n, D)
        v = v_pool.reshape(-1, h, d)[slots].double().transpose(0, 1)
        out[row] = (q[row].double() @ k.transpose(1, 2) * scale).softmax(-1) @ v
    return out

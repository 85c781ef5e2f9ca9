"""oasr.layers.conformer: shapes, op overrides, and cache-equivalence of the streaming paths."""

from __future__ import annotations

import pytest
import torch

import oasr.layers as L
from oasr.layers.conformer import (
    ConformerConvModule,
    Conv2dSubsampling,
    RelPositionalEncoding,
    RelPositionMultiHeadAttention,
)


@pytest.mark.parametrize("rate,ctx", [(4, 6), (6, 10), (8, 14)])
def test_subsampling_lengths(rate, ctx) -> None:
    sub = Conv2dSubsampling(40, 16, rate)
    assert sub.right_context == ctx
    for n in (ctx + 1, 50, 101):
        y = sub(torch.randn(2, n, 40))
        assert y.shape == (2, sub.output_length(n), 16)
    assert sub.output_length(ctx) == 0
    assert sub.output_length(torch.tensor([ctx, ctx + 1])).tolist() == [0, 1]


@pytest.mark.parametrize("norm", ["batch_norm", "layer_norm"])
def test_causal_conv_cache_equals_full(norm) -> None:
    torch.manual_seed(0)
    m = ConformerConvModule(8, 5, causal=True, norm=norm).eval()
    x = torch.randn(1, 23, 8)
    full, _ = m(x)
    outs, cache = [], None
    for a, b in [(0, 7), (7, 8), (8, 20), (20, 23)]:
        y, cache = m(x[:, a:b], cache=cache)
        outs.append(y)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-6)
    # rows of different valid lengths in one call: the cache ends at each row's last valid frame
    xb = torch.zeros(2, 9, 8)
    xb[0] = x[0, :9]
    xb[1, :4] = x[0, :4]
    valid = torch.arange(9)[None] < torch.tensor([9, 4])[:, None]
    _, c = m(xb, valid, lengths=torch.tensor([9, 4]))
    _, c9 = m(x[:, :9])
    _, c4 = m(x[:, :4])
    assert torch.allclose(c[0], c9[0]) and torch.allclose(c[1], c4[0])


def test_rel_attention_cache_equals_masked_full() -> None:
    torch.manual_seed(0)
    att = RelPositionMultiHeadAttention(16, 2).eval()
    with torch.no_grad():
        att.pos_bias_u.normal_()
        att.pos_bias_v.normal_()
    pe = RelPositionalEncoding(16)
    x = torch.randn(1, 12, 16)
    chunk = 4
    mask = (torch.arange(12)[None, :] < ((torch.arange(12) // chunk + 1) * chunk)[:, None])[None]
    full, _ = att(x, pe.range(0, 12), mask)
    outs, cache = [], None
    for s in range(0, 12, chunk):
        tc = 0 if cache is None else cache[0].shape[2]
        y, cache = att(x[:, s : s + chunk], pe.range(s - tc, tc + chunk), None, cache)
        outs.append(y)
    assert torch.allclose(torch.cat(outs, 1), full, atol=1e-5)
    # gathered per-row positions equal the contiguous range
    assert torch.equal(pe.gather(torch.arange(3, 7)[None]), pe.range(3, 4))
    assert pe.gather(torch.tensor([[9000]])).shape == (1, 1, 16)  # the table grows on demand


def test_new_ops_overridable() -> None:
    for op in ("conv2d", "depthwise_conv1d", "batch_norm", "glu", "swish"):
        assert op in L.KNOWN_OPS
    calls = []

    def fake(module, x):
        calls.append(x.shape)
        return NotImplemented

    sub = Conv2dSubsampling(20, 4, 4)
    with L.override("conv2d", "cpu", fake):
        sub(torch.randn(1, 30, 20))
    assert len(calls) == 2
    with L.override("swish", "cpu", lambda x: torch.zeros_like(x)):
        assert L.swish(torch.ones(3)).sum() == 0

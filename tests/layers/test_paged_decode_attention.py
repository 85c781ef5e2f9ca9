"""oasr.layers.paged_decode_attention: the native op against an explicit per-row reference."""

from __future__ import annotations

import pytest
import torch

import oasr.layers as L
from oasr.kv_cache import PagedKVCache


def reference(q, k_pool, v_pool, tables, lengths, scale=None):
    """Dense attention over each row's valid keys, located one by one, in float64."""
    b, h, _, d = q.shape
    bs = k_pool.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = torch.empty(b, h, 1, d, dtype=torch.float64)
    for row in range(b):
        keys, values = [], []
        for p in range(int(lengths[row])):
            block = int(tables[row, p // bs])
            keys.append(k_pool[block, p % bs].double())  # (H, D)
            values.append(v_pool[block, p % bs].double())
        k, v = torch.stack(keys, 1), torch.stack(values, 1)  # (H, n, D)
        weights = (q[row].double() @ k.transpose(1, 2) * scale).softmax(-1)  # (H, 1, n)
        out[row] = weights @ v
    return out


def make_inputs(b=5, h=3, d=16, bs=4, nb=6, num_blocks=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(num_blocks, bs, h, d, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, bs, h, d, generator=g).to(dtype)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    # shuffled, non-contiguous block ids (block 0 is the cache's scratch block: never used)
    tables = torch.stack([torch.randperm(num_blocks - 1, generator=g)[:nb] + 1 for _ in range(b)])
    full = nb * bs
    lengths = torch.tensor([[1, full, 7, bs, bs + 1, full - 1][i % 6] for i in range(b)])
    return q, k_pool, v_pool, tables, lengths


@pytest.mark.parametrize("b,h,d,bs,nb", [(5, 3, 16, 4, 6), (7, 2, 64, 16, 5), (1, 4, 8, 16, 1)])
def test_native_matches_reference(b, h, d, bs, nb):
    q, kp, vp, tables, lengths = make_inputs(b, h, d, bs, nb)
    out = L.paged_decode_attention(q, kp, vp, tables, lengths)
    assert out.shape == (b, h, 1, d) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), reference(q, kp, vp, tables, lengths), atol=1e-5, rtol=1e-5)


def test_native_scale_and_full_table():
    q, kp, vp, tables, _ = make_inputs(b=3, nb=4, bs=8)
    lengths = torch.full((3,), 32)
    out = L.paged_decode_attention(q, kp, vp, tables, lengths, scale=0.3)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, tables, lengths, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 3e-3), (torch.bfloat16, 2e-2)])
def test_native_half_precision(dtype, tol):
    q, kp, vp, tables, lengths = make_inputs(dtype=dtype)
    out = L.paged_decode_attention(q, kp, vp, tables, lengths)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), reference(q, kp, vp, tables, lengths), atol=tol, rtol=tol)


def test_native_equals_gather_and_masked_attention_over_a_paged_cache():
    """What the Whisper executor computes for a decode step: cache.gather + attention + mask."""
    cache = PagedKVCache(2, num_blocks=12, block_size=4, num_heads=2, head_dim=8)
    for pool in (*cache.k, *cache.v):
        pool.normal_()
    tables = torch.tensor([[3, 7, 1], [9, 2, 11]])
    lengths = torch.tensor([10, 3])
    q = torch.randn(2, 2, 1, 8)
    kk, vv = cache.gather(1, tables)
    mask = (torch.arange(12)[None, :] < lengths[:, None])[:, None, None, :]
    expected = L.attention(q, kk, vv, mask)
    out = L.paged_decode_attention(q, cache.k[1], cache.v[1], tables, lengths)
    torch.testing.assert_close(out, expected)


def test_op_is_overridable():
    assert "paged_decode_attention" in L.KNOWN_OPS
    q, kp, vp, tables, lengths = make_inputs()
    seen = []

    def fake(*args):
        seen.append(len(args))
        return torch.zeros_like(args[0])

    with L.override("paged_decode_attention", "cpu", fake):
        assert torch.count_nonzero(L.paged_decode_attention(q, kp, vp, tables, lengths)) == 0
    assert seen == [6]  # q, k_pool, v_pool, block_tables, lengths, scale

    with L.override("paged_decode_attention", "cpu", lambda *a: NotImplemented):
        out = L.paged_decode_attention(q, kp, vp, tables, lengths)
    torch.testing.assert_close(out.double(), reference(q, kp, vp, tables, lengths), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 1), (8, 4)])
def test_native_grouped_query_heads(h, hkv):
    """Pools hold H_kv heads; query head h reads kv head h // (H // H_kv) (transformers' repeat_kv)."""
    q, kp, vp, tables, lengths = make_inputs(b=4, h=h, d=16, bs=4, nb=5)
    kp, vp = kp[:, :, :hkv].contiguous(), vp[:, :, :hkv].contiguous()
    out = L.paged_decode_attention(q, kp, vp, tables, lengths)
    assert out.shape == q.shape
    g = h // hkv
    want = reference(q, kp.repeat_interleave(g, dim=2), vp.repeat_interleave(g, dim=2), tables, lengths)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_grouped_attention_with_a_causal_mask_equals_repeated_heads():
    from oasr.layers.attention import grouped_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 5, 8, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    mask = (torch.arange(9)[None, None, :] <= torch.tensor([[4, 5, 6, 7, 8], [0, 1, 2, 3, 4]])[:, :, None])[:, None]
    out = grouped_attention(q, k, v, mask)
    want = L.attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), mask)
    torch.testing.assert_close(out, want)

from __future__ import annotations

import pytest
import torch

from oasr.kv_cache import BlockAllocator, PagedKVCache, blocks_for


def test_allocator_counts_and_reuse():
    a = BlockAllocator(5)
    assert a.capacity == 4 and a.num_free == 4
    x = a.allocate(3)
    assert 0 not in x and len(set(x)) == 3
    assert not a.can_allocate(2)
    with pytest.raises(MemoryError):
        a.allocate(2)
    a.free(x)
    assert a.num_free == 4
    assert blocks_for(17, 16) == 2 and blocks_for(0, 16) == 1


def test_paged_write_gather_matches_dense():
    torch.manual_seed(0)
    c = PagedKVCache(num_layers=1, num_blocks=9, block_size=4, num_heads=2, head_dim=3)
    lens = [5, 9]
    tables = [c.allocator.allocate(blocks_for(n, 4)) for n in lens]
    dense = [torch.randn(n, 2, 3) for n in lens]
    for t, d in zip(tables, dense, strict=False):
        slots = torch.tensor([t[p // 4] * 4 + p % 4 for p in range(d.shape[0])])
        c.write(0, slots, d, -d)
    nb = 3
    tab = torch.tensor([(t + [0] * nb)[:nb] for t in tables])
    k, v = c.gather(0, tab)
    assert k.shape == (2, 2, nb * 4, 3)
    for i, d in enumerate(dense):
        torch.testing.assert_close(k[i, :, : d.shape[0]], d.transpose(0, 1))
        torch.testing.assert_close(v[i, :, : d.shape[0]], -d.transpose(0, 1))

"""A block-pool (paged) key/value cache for autoregressive decoders.

Every sequence owns a *block table*: the ids of fixed-size blocks (``block_size`` token positions
each) in one pool shared by all sequences. Rows join and leave the running batch at any step: a
finished sequence returns its blocks to the pool, a new one takes free blocks. Memory is fixed at
construction (``num_blocks``), so admission control is a matter of counting free blocks
(:meth:`BlockAllocator.can_allocate`) and never an out-of-memory error mid-decode.

* :class:`BlockAllocator`: pure-python free list (no torch), with reservation of a sequence's
  worst-case block count at admission;
* :class:`PagedKVCache`: the per-layer K/V tensors ``(num_blocks, block_size, heads, head_dim)``;
  :meth:`~PagedKVCache.write` scatters new K/V by flat slot index and :meth:`~PagedKVCache.gather`
  returns a dense ``(B, heads, n_blocks * block_size, head_dim)`` view for attention. Block 0 is a
  scratch block never handed out: padded rows of a static (CUDA-graph) batch write there.
  With ``kv_dtype="fp8"`` the pools hold float8 e4m3 values (as bytes) and ``k_scale`` /
  ``v_scale`` one float32 scale per (slot, head): each written key/value vector is scaled by
  its own max / 448 (docs/quantization.md).

The shapes touched per step depend only on (batch size, number of gathered blocks), so a decoder
step over this cache can be captured once per shape bucket and replayed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from oasr.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

__all__ = ["BlockAllocator", "PagedKVCache", "blocks_for", "rows_fit_words", "store_rows"]


def blocks_for(num_tokens: int, block_size: int) -> int:
    return max(1, math.ceil(num_tokens / block_size))


def store_rows(dst: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``dst[index] = rows`` for ``dst`` (S, W) and ``rows`` (N, W) (``index_copy_``), the rows
    moved as 16-byte words where both layouts allow: torch's index copy moves one element per
    thread, so a bf16 K/V write (Qwen2-Audio 7B's prefill of 32 prompts: 24k rows of 4096) ran
    at a third of the memory bandwidth. The same bytes either way."""
    import torch

    if dst.dtype == rows.dtype and rows_fit_words(dst) and rows_fit_words(rows):
        dst, rows = dst.view(torch.complex128), rows.view(torch.complex128)
    dst.index_copy_(0, index, rows)


def rows_fit_words(x: torch.Tensor) -> bool:
    """Whether every row of the 2-D ``x`` is whole, aligned 16-byte words (a complex128 view)."""
    size = x.element_size()
    return (x.dim() == 2 and x.stride(1) == 1 and 16 % size == 0 and (x.shape[1] * size) % 16 == 0
            and (x.stride(0) * size) % 16 == 0 and (x.storage_offset() * size) % 16 == 0
            and x.data_ptr() % 16 == 0)  # fmt: skip


class BlockAllocator:
    """Free list of block ids ``1 .. num_blocks-1`` (0 is the scratch block)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise InvalidRequestError("a paged KV cache needs at least 2 blocks", param="kv_cache")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, 0, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"KV cache: {n} blocks asked for, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)


class PagedKVCache:
    """Per-layer K and V pools of shape (num_blocks, block_size, num_heads, head_dim)."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_heads: int,
                 head_dim: int, *, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, zero_on_allocate: bool = False,
                 kv_dtype: str | None = None) -> None:  # fmt: skip
        import torch

        if kv_dtype not in (None, "fp8"):
            raise InvalidRequestError(f"kv_cache_dtype {kv_dtype!r}: use None or 'fp8'", param="kv_cache_dtype")
        #: "fp8": float8 e4m3 pools (stored as uint8) with per-(slot, head) float32 scales
        self.fp8 = kv_dtype == "fp8"
        #: the dtype attention reads (the fp8 pools are dequantized to it)
        self.compute_dtype = dtype or torch.float32
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads = num_heads
        self.head_dim = head_dim
        shape = (num_blocks, block_size, num_heads, head_dim)
        kw = {"device": device, "dtype": torch.uint8 if self.fp8 else self.compute_dtype}
        #: blocks are zeroed when handed out (:meth:`allocate`), not all at once here: on CPU
        #: the pages of blocks never used are then never touched (tiny.en, 16 rows: 88 MB)
        self.zero_on_allocate = zero_on_allocate
        alloc = torch.empty if zero_on_allocate else torch.zeros
        self.k = [alloc(shape, **kw) for _ in range(num_layers)]
        self.v = [alloc(shape, **kw) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.fp8:
            skw = {"device": device, "dtype": torch.float32}
            self.k_scale = [alloc(shape[:3], **skw) for _ in range(num_layers)]
            self.v_scale = [alloc(shape[:3], **skw) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        if zero_on_allocate:
            self.clear([0])  # the scratch block: padding reads it

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks (:meth:`BlockAllocator.allocate`), zeroed with ``zero_on_allocate``."""
        blocks = self.allocator.allocate(n)
        if self.zero_on_allocate:
            self.clear(blocks)
        return blocks

    def clear(self, blocks: Sequence[int]) -> None:
        """Zero ``blocks`` in every layer's K and V (positions past a row's length are read and
        masked: they must hold finite values)."""
        for t in (*self.k, *self.v, *self.k_scale, *self.v_scale):
            for b in blocks:
                t[b].zero_()

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_heads: int, head_dim: int,
                        element_size: int, kv_dtype: str | None = None) -> int:  # fmt: skip
        if kv_dtype == "fp8":  # one byte per element plus a float32 scale per (slot, head)
            return 2 * num_layers * block_size * num_heads * (head_dim + 4)
        return 2 * num_layers * block_size * num_heads * head_dim * element_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v, *self.k_scale, *self.v_scale))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` (N, heads, head_dim) at flat slot indices ``slots`` (N,)
        (``block_id * block_size + offset``); quantized per (slot, head) in an fp8 cache."""
        if self.fp8:
            from oasr.layers.quantized import quantize_kv_into

            # quantized and scattered to the slots in one op (one kernel per tensor on CUDA)
            for pool, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
                quantize_kv_into(x.unsqueeze(1), pool[layer].view(-1, 1, self.num_heads, self.head_dim),
                                 scales[layer].view(-1, 1, self.num_heads), slots)  # fmt: skip
            return
        width = self.num_heads * self.head_dim  # whole slots as rows: 16-byte words (store_rows)
        store_rows(self.k[layer].view(-1, width), slots, k.reshape(-1, width))
        store_rows(self.v[layer].view(-1, width), slots, v.reshape(-1, width))

    def dequantized_blocks(self, layer: int, block_tables: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """An fp8 cache's blocks of ``block_tables`` (B, n), dequantized to ``compute_dtype``:
        K and V pools (B * n, block_size, heads, head_dim) and the tables into them (B, n)."""
        from oasr.layers.quantized import dequantize_blocks

        return dequantize_blocks(self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer],
                                 block_tables, self.compute_dtype)  # fmt: skip

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K, V (B, heads, n * block_size, head_dim) for ``block_tables`` (B, n)."""
        b, n = block_tables.shape
        if self.fp8:
            k, v, _ = self.dequantized_blocks(layer, block_tables)
        else:
            flat = block_tables.reshape(-1)
            k = self.k[layer].index_select(0, flat)
            v = self.v[layer].index_select(0, flat)
        k = k.view(b, n * self.block_size, self.num_heads, self.head_dim)
        v = v.view(b, n * self.block_size, self.num_heads, self.head_dim)
        return k.transpose(1, 2), v.transpose(1, 2)

"""Multi-head attention with masks, an incremental KV cache and precomputed cross-attention K/V.

Shapes: queries/keys/values inside the op are (B, H, T, D). Masks follow PyTorch conventions:

* ``key_padding_mask``: (B, S) bool, **True marks padding** (a key to ignore).
* ``attn_mask``: bool (True = may attend) or additive float, broadcastable to (B, H, T, S).
* ``causal=True``: query ``i`` (absolute position ``past + i``) sees keys ``0 .. past + i``,
  where ``past`` is the number of positions already in the cache.

The core ``softmax(q k^T * scale) v`` is the overridable op ``"attention"``; its native
implementation is ``torch.nn.functional.scaled_dot_product_attention``. When attention weights
are requested (word alignment) the core is computed explicitly instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from oasr.layers._dispatch import call_op, declare_op
from oasr.layers.basic import Linear

_ATTENTION = declare_op("attention")


_CUDA_BACKENDS: list | None = None
_CUDNN_FIRST: list | None = None
_PREFER_CUDNN: ContextVar[bool] = ContextVar("oasr_attention_prefer_cudnn", default=False)


def _cuda_backends() -> list:
    # cuDNN's SDPA builds a new execution plan for every new key length, which costs
    # milliseconds of CPU per call during incremental decoding (seen: 6.5 ms per call with
    # torch 2.11 on an H200 against 10 us of GPU work). The native op therefore lets PyTorch
    # pick among flash, memory-efficient and math only, unless the caller declares fixed shapes
    # (:func:`fixed_shape_attention`); a kernel provider may override.
    global _CUDA_BACKENDS, _CUDNN_FIRST
    if _CUDA_BACKENDS is None:
        from torch.nn.attention import SDPBackend

        _CUDA_BACKENDS = [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ]
        _CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, *_CUDA_BACKENDS]
    return _CUDNN_FIRST if _PREFER_CUDNN.get() else _CUDA_BACKENDS


@contextmanager
def fixed_shape_attention() -> Iterator[None]:
    """Inside this block the native CUDA attention tries cuDNN's SDPA kernel first.

    For callers whose key length does not change from call to call: an encoder over a fixed
    window, cross-attention over that encoder's output, a step captured in a CUDA graph. There
    cuDNN's one-off planning cost is paid once per shape, and its kernel is faster on Hopper
    (H200, torch 2.11, fp16: 1500-frame cross-attention of 64 rows x 20 heads in 120 us against
    252 us for flash; 1500x1500 self-attention of the same batch in 1.86 ms against 2.55 ms).
    Shapes cuDNN refuses fall through to flash, memory-efficient and math, in that order."""
    token = _PREFER_CUDNN.set(True)
    try:
        yield
    finally:
        _PREFER_CUDNN.reset(token)


def _attention_native(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
) -> torch.Tensor:
    if q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel(_cuda_backends(), set_priority=True):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale
            )
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """``softmax(q k^T * scale + mask) v`` over (B, H, T, D) tensors; ``is_causal`` only for
    square (T == S) problems. Overridable op ``"attention"``."""
    return call_op(_ATTENTION, q.device.type, _attention_native, q, k, v, mask, is_causal, scale)


#: the row stride (elements) of a float mask that the memory-efficient SDPA kernel reads as it
#: is; a mask with another row stride is first copied into a padded tensor by PyTorch
_MASK_ALIGN = 16


def position_bias(
    q: torch.Tensor,
    pos: torch.Tensor,
    scale: float,
    *,
    shift_keys: int | None = None,
    mask: torch.Tensor | None = None,
    fill: float = float("-inf"),
) -> torch.Tensor:
    """The position term of relative-position attention as an additive SDPA mask:
    ``scale * q . pos^T`` per head, (B, H, T, S).

    ``q`` (B, T, H, D): the queries with their position bias added (``q + pos_bias_v``), in the
    layout the projection gives. ``pos`` (P, H, D) or (1, P, H, D) (one table for the batch) or
    (B, P, H, D): projected position embeddings. Without ``shift_keys`` column j is key j
    (P == S: WeNet/ESPnet's "latest" form). With ``shift_keys=S`` the table covers relative
    distances ``S-1 .. -(S-1)`` (P == 2S - 1) and column j of query i is distance
    ``(S - T + i) - j`` (Transformer-XL's shift, NeMo/icefall), taken as a strided view.
    ``mask`` (bool, broadcastable to (B, H, T, S), True = may attend) adds ``fill`` where False
    (pick a finite ``fill`` with headroom, or -inf where no row is fully masked).

    Why not ``matmul(q, pos^T) * scale`` in (B, H, T, D): with one table for the batch that
    matmul runs as a batched GEMM over a broadcast operand (a slow legacy kernel on Hopper), and
    the scale, the shift and the mask are each a pass over the largest tensor of the layer. Here
    the table is scaled (it is small), the GEMM is one per head over all B*T queries with an
    aligned output, and the shift and mask are folded into the one write of the result, into a
    buffer whose rows are aligned for the attention kernel (so SDPA does not copy it again).
    H200, Parakeet-0.6B layer (128 x 376 frames, 8 heads x 128, fp16): 3.13 -> 1.38 ms with SDPA."""
    b, t, h, d = q.shape
    pos = pos * scale
    if pos.dim() == 3 or pos.shape[0] == 1:
        table = pos.reshape(-1, h, d)  # (P, H, D)
        p = table.shape[0]
        # the GEMM's output rows padded to a multiple of 8 columns: an odd row length (2S - 1
        # always is) sends cuBLAS to a legacy kernel at a tenth of the tensor-core rate
        aligned = -(-p // 8) * 8
        if aligned != p:
            table = F.pad(table, (0, 0, 0, 0, 0, aligned - p))
        scores = torch.matmul(q.reshape(b * t, h, d).transpose(0, 1), table.permute(1, 2, 0))
        scores = scores.view(h, b, t, aligned).transpose(0, 1)[..., :p]  # (B, H, T, P), a view
    else:
        p = pos.shape[1]
        scores = torch.matmul(q.transpose(1, 2), pos.permute(0, 2, 3, 1))  # (B, H, T, P)
    if shift_keys is not None:
        s = shift_keys
        if p != 2 * s - 1:
            raise ValueError(f"a shifted position table needs {2 * s - 1} rows, got {p}")
        sb, sh, st, sp = scores.stride()
        if sp != 1:
            scores = scores.contiguous()
            sb, sh, st, sp = scores.stride()
        # row i starts at column T - 1 - i (distance S - T + i); one column further per key;
        # the (S - T) keys before the queries (a cache) lie to the left of that diagonal
        scores = scores.as_strided((b, h, t, s), (sb, sh, st - 1, 1),
                                   scores.storage_offset() + (s - 1) - (s - t))
    else:
        s = p
    padded = -(-s // _MASK_ALIGN) * _MASK_ALIGN
    out = torch.empty(b, h, t, padded, dtype=scores.dtype, device=scores.device)[..., :s]
    if mask is None:
        return out.copy_(scores)
    # the mask as an additive term without the head axis (an eighth of the scores' size or
    # less), added in the same pass that writes the scores
    additive = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    additive.masked_fill_(~mask, fill)
    if scores.requires_grad:  # out= takes no autograd; two passes are fine off inference
        return out.copy_(scores).add_(additive)
    return torch.add(scores, additive, out=out)


_PAGED_DECODE_ATTENTION = declare_op("paged_decode_attention")


def grouped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`attention` with fewer key/value heads than query heads (grouped-query attention).

    ``q`` (B, H, T, D); ``k``/``v`` (B, H_kv, S, D) with ``H % H_kv == 0``: query head ``h``
    attends with key/value head ``h // (H // H_kv)`` (the grouping of ``transformers``'
    ``repeat_kv``). ``mask`` broadcastable to (B, 1, T, S) (one mask for every head). The group's
    queries are folded into the time axis, (B, H_kv, G * T, D), so the keys and values are read
    in place and never repeated. With ``H_kv == H`` this is :func:`attention`."""
    b, h, t, d = q.shape
    hkv = k.shape[1]
    if hkv == h:
        return attention(q, k, v, mask, False, scale)
    if h % hkv:
        raise ValueError(f"{h} query heads cannot share {hkv} key/value heads")
    g = h // hkv
    qg = q.reshape(b, hkv, g * t, d)
    if mask is not None:
        if mask.dim() != 4 or mask.shape[1] != 1:
            raise ValueError("grouped attention takes a mask broadcastable to (B, 1, T, S)")
        m = mask.expand(mask.shape[0], 1, t, mask.shape[-1])
        mask = m[:, :, None].expand(m.shape[0], 1, g, t, m.shape[-1]).reshape(m.shape[0], 1, g * t, m.shape[-1])
    out = attention(qg, k, v, mask, False, scale)
    return out.reshape(b, h, t, v.shape[-1])


def _paged_decode_attention_native(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    # Gather every row's blocks into dense (B, H_kv, nb * block_size, D) keys/values and mask
    # the tail. Shapes depend only on (B, nb) and nothing reads back to the host, so this stays
    # capturable in a CUDA graph. Fewer key/value heads than query heads: grouped_attention.
    b = q.shape[0]
    nb = block_tables.shape[1]
    bs, hkv = k_pool.shape[1], k_pool.shape[2]
    flat = block_tables.reshape(-1)
    k = k_pool.index_select(0, flat).view(b, nb * bs, hkv, k_pool.shape[-1]).transpose(1, 2)
    v = v_pool.index_select(0, flat).view(b, nb * bs, hkv, v_pool.shape[-1]).transpose(1, 2)
    keys = torch.arange(nb * bs, device=q.device)
    mask = (keys[None, :] < lengths.to(q.device)[:, None])[:, None, None, :]  # (B, 1, 1, S)
    return grouped_attention(q, k, v, mask, scale)


def paged_decode_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """One decode step of attention over a paged KV cache (:class:`oasr.kv_cache.PagedKVCache`).

    ``q`` (B, H, 1, D); ``k_pool``/``v_pool`` (num_blocks, block_size, H_kv, D), one layer's
    pools, with ``H_kv`` dividing ``H`` (grouped-query attention: query head ``h`` reads key/value
    head ``h // (H // H_kv)``; ``H_kv == H`` is plain multi-head attention);
    ``block_tables`` (B, nb) int64 block ids; ``lengths`` (B,) int64 valid keys per row, with
    ``1 <= lengths[b] <= nb * block_size``. Key ``p`` of row ``b`` is at block
    ``block_tables[b, p // block_size]``, offset ``p % block_size``. Returns (B, H, 1, D) in
    ``q``'s dtype: ``softmax(q k^T * scale) v`` over each row's first ``lengths[b]`` keys
    (``scale`` defaults to ``D ** -0.5``). Overridable op ``"paged_decode_attention"``; the
    native code gathers the blocks and calls :func:`grouped_attention` with a key-padding mask.
    A kernel that does not handle grouped heads returns ``NotImplemented`` for them."""
    return call_op(
        _PAGED_DECODE_ATTENTION,
        q.device.type,
        _paged_decode_attention_native,
        q,
        k_pool,
        v_pool,
        block_tables,
        lengths,
        scale,
    )


_PAGED_PREFILL_ATTENTION = declare_op("paged_prefill_attention")


def _paged_prefill_attention_native(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    # Dense keys/values gathered from the rows' blocks and a causal mask by position.
    b, _, t, _ = q.shape
    nb = block_tables.shape[1]
    bs, hkv, d = k_pool.shape[1], k_pool.shape[2], k_pool.shape[3]
    flat = block_tables.reshape(-1)
    k = k_pool.index_select(0, flat).view(b, nb * bs, hkv, d).transpose(1, 2)
    v = v_pool.index_select(0, flat).view(b, nb * bs, hkv, v_pool.shape[-1]).transpose(1, 2)
    keys = torch.arange(nb * bs, device=q.device)
    positions = lengths.to(q.device)[:, None] - t + torch.arange(t, device=q.device)[None, :]
    mask = (keys[None, None, :] <= positions[:, :, None])[:, None]  # (B, 1, T, S)
    return grouped_attention(q, k, v, mask, scale)


def paged_prefill_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of a block of ``T`` new tokens per row over a paged KV cache (a
    prefill, or several tokens at once), their keys/values already written to the pools.

    ``q`` (B, H, T, D); pools, ``block_tables`` and ``lengths`` as for
    :func:`paged_decode_attention`, ``lengths[b]`` counting the new tokens (``>= T``). Query
    ``i`` of row ``b`` sits at position ``lengths[b] - T + i`` and sees keys ``0 ..`` that
    position. Returns (B, H, T, D) in ``q``'s dtype. Overridable op
    ``"paged_prefill_attention"``; the native code gathers the blocks and calls
    :func:`grouped_attention` with a causal mask."""
    return call_op(
        _PAGED_PREFILL_ATTENTION,
        q.device.type,
        _paged_prefill_attention_native,
        q,
        k_pool,
        v_pool,
        block_tables,
        lengths,
        scale,
    )


def attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit attention returning (output, softmaxed weights (B, H, T, S) in float32)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    weights = scores.softmax(dim=-1)
    out = torch.matmul(weights.to(v.dtype), v)
    return out, weights


def causal_mask(t: int, past: int, device: torch.device) -> torch.Tensor:
    """(t, past + t) bool mask, True where query ``i`` may see key ``j`` (``j <= past + i``)."""
    return torch.ones(t, past + t, dtype=torch.bool, device=device).tril(diagonal=past)


def build_mask(
    t: int,
    s: int,
    *,
    past: int = 0,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, bool]:
    """Combine the mask kinds into one SDPA mask. Returns (mask, use_is_causal)."""
    if causal and past == 0 and key_padding_mask is None and attn_mask is None and t == s:
        return None, t > 1
    mask: torch.Tensor | None = None
    if causal and t > 1:
        mask = causal_mask(t, past, device)[None, None]
    if key_padding_mask is not None:
        keep = (~key_padding_mask.to(device=device, dtype=torch.bool))[:, None, None, :]
        mask = keep if mask is None else (mask & keep)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else (mask & attn_mask)
        else:
            add = attn_mask.to(dtype)
            if mask is not None:
                add = add.masked_fill(~mask, float("-inf"))
            mask = add
    return mask, False


class KVCache:
    """Self-attention keys/values of one layer, (B, H, T, D), grown in place.

    Storage is over-allocated (capacity doubles) so appending one token per step does not copy
    the whole history each time. :meth:`reorder` selects/duplicates batch rows (beam search).
    """

    def __init__(self, initial_capacity: int = 64) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self._len = 0
        self._initial = initial_capacity

    @property
    def length(self) -> int:
        return self._len

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, H, T, D) keys/values; return views of all cached positions."""
        t = k.shape[2]
        needed = self._len + t
        if self.k is None or needed > self.k.shape[2] or self.k.shape[0] != k.shape[0]:
            cap = max(self._initial, needed)
            if self.k is not None:
                cap = max(cap, 2 * self.k.shape[2])
            b, h, _, d = k.shape
            new_k = k.new_empty(b, h, cap, d)
            new_v = v.new_empty(b, h, cap, v.shape[-1])
            if self.k is not None and self._len:
                new_k[:, :, : self._len] = self.k[:, :, : self._len]
                new_v[:, :, : self._len] = self.v[:, :, : self._len]
            self.k, self.v = new_k, new_v
        assert self.v is not None
        self.k[:, :, self._len : needed] = k
        self.v[:, :, self._len : needed] = v
        self._len = needed
        return self.k[:, :, :needed], self.v[:, :, :needed]

    def reorder(self, index: torch.Tensor) -> None:
        if self.k is None:
            return
        assert self.v is not None
        index = index.to(self.k.device)
        self.k = self.k[:, :, : self._len].index_select(0, index)
        self.v = self.v[:, :, : self._len].index_select(0, index)

    def clear(self) -> None:
        self.k = self.v = None
        self._len = 0


#: query x key positions from which :attr:`MultiHeadAttention.attention_dtype` applies (a 30 s
#: Whisper window: 1500 x 1500; a decode step: 1 x its keys)
LONG_ATTENTION = 256 * 256


class MultiHeadAttention(nn.Module):
    """Multi-head attention with separate q/k/v/out :class:`Linear` projections.

    * self-attention: ``attn(x, causal=True, cache=kv_cache)`` appends this step's K/V;
    * cross-attention: ``k, v = attn.project_kv(memory)`` once per input, then
      ``attn(x, static_kv=(k, v), key_padding_mask=...)`` at every step;
    * ``need_weights=True`` also returns the softmaxed weights (B, H, T, S) in float32.

    ``key_bias=False`` drops the key projection bias (Whisper); a constant key bias cannot change
    a softmax over keys, so dropping it is exact.

    ``attention_dtype`` (None: the inputs' dtype): on the CPU, an unmasked attention of at least
    :data:`LONG_ATTENTION` query x key positions (an encoder's self-attention over a window, not a
    decode step) runs its softmax(q k^T) v in this dtype, the projections staying as they are.
    int8 quantization on the CPU sets bfloat16 (:func:`oasr.quantization.apply.quantize_module`).
    """

    #: per-instance override: the dtype of long unmasked CPU attention (class docstring)
    attention_dtype: torch.dtype | None = None

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        *,
        kv_dim: int | None = None,
        bias: bool = True,
        key_bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} is not divisible by num_heads {num_heads}")
        kv_dim = embed_dim if kv_dim is None else kv_dim
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        kw = {"device": device, "dtype": dtype}
        self.q_proj = Linear(embed_dim, embed_dim, bias=bias, **kw)
        self.k_proj = Linear(kv_dim, embed_dim, bias=bias and key_bias, **kw)
        self.v_proj = Linear(kv_dim, embed_dim, bias=bias, **kw)
        self.out_proj = Linear(embed_dim, embed_dim, bias=bias, **kw)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, S, kv_dim) -> keys, values (B, H, S, D), for cross-attention reuse."""
        return self._split(self.k_proj(memory)), self._split(self.v_proj(memory))

    def forward(
        self,
        x: torch.Tensor,
        memory: torch.Tensor | None = None,
        *,
        static_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: KVCache | None = None,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` (B, T, C). Keys/values come from ``static_kv`` if given, else from ``memory``
        (cross-attention) or ``x`` (self-attention, appended to ``cache`` when given)."""
        b, t, _ = x.shape
        q = self._split(self.q_proj(x))
        past = 0
        if static_kv is not None:
            k, v = static_kv
        else:
            k, v = self.project_kv(x if memory is None else memory)
            if cache is not None:
                past = cache.length
                k, v = cache.append(k, v)
        s = k.shape[2]
        mask, is_causal = build_mask(
            t,
            s,
            past=past,
            causal=causal,
            key_padding_mask=key_padding_mask,
            attn_mask=attn_mask,
            device=x.device,
            dtype=q.dtype,
        )
        weights = None
        if need_weights:
            if is_causal:
                mask = causal_mask(t, past, x.device)
            out, weights = attention_with_weights(q, k, v, mask)
        elif (
            self.attention_dtype is not None and mask is None and q.device.type == "cpu"
            and t * s >= LONG_ATTENTION and q.dtype != self.attention_dtype
        ):  # fmt: skip
            cd = self.attention_dtype
            out = attention(q.to(cd), k.to(cd), v.to(cd), None, is_causal).to(q.dtype)
        else:
            out = attention(q, k, v, mask, is_causal)
        out = self.out_proj(out.transpose(1, 2).reshape(b, t, self.embed_dim))
        if need_weights:
            assert weights is not None
            return out, weights
        return out

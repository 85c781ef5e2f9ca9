"""Continuous batching of an autoregressive decoder, shared by every family that has one.

The unit of work is a :class:`Window`: an encoder input, the features the encoder makes of it, a
prompt (the initial tokens) and a budget of tokens to sample. Whisper makes one window per 30 s of
audio (and one more per temperature fallback); a speech-LLM makes one per request. A window that
is decoding owns a *row* of the decoder batch. Every :meth:`AutoregressiveExecutor.step`:

1. requests admitted since the last step are handed to the driver in one batch
   (:meth:`RequestDriver.begin`: Whisper runs its VAD gate there), which queues their first
   windows for encoding or finishes them at once;
2. queued windows are encoded in one batch (on CUDA, while rows decode, on a second stream so the
   compute-bound encoder overlaps the memory-bound decode steps; the result is picked up in a
   later step); the driver turns the features into a prompt (:meth:`RequestDriver.encoded`);
3. windows whose KV blocks can be reserved start: their cross-attention K/V (when the step model
   has cross-attention) is projected once into the row's slot of the cross pool, and their
   prompts run as a prefill grouped by length (its keys/values go into the cache, its attention
   reads them as computed: one causal SDPA call per layer, not a read back from the pools);
4. all rows advance by one token in one decoder call over the paged self-attention cache
   (:class:`oasr.kv_cache.PagedKVCache`), replayed from a captured CUDA graph per (batch, blocks)
   bucket on GPU;
5. a row that samples a stop token or reaches its budget ends: its blocks return to the pool, the
   last row moves into its place (rows stay dense, so cross-attention reads the pool without a
   gather), and the driver decides what follows (:meth:`RequestDriver.finished`: the next window,
   the same window again at another temperature, or the request's result).

Sampling is per row: suppressed tokens at every step and at the first step, the driver's own
rules (:meth:`RequestDriver.process_logits`), then argmax or temperature / top-k / top-p sampling,
with one device-to-host copy per step. Requests the driver does not run here (Whisper's beam
search) go to a :class:`oasr.scheduler.BatchExecutor` beside it. Failures are per request.

What a family writes: a :class:`StepModel` and a :class:`RequestDriver`; see ``docs/engine.md``.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from oasr.errors import InvalidRequestError
from oasr.kv_cache import PagedKVCache, blocks_for, store_rows
from oasr.layers import (
    attention,
    install_kernel_providers,
    paged_decode_attention,
    paged_prefill_attention,
)
from oasr.layers.attention import fixed_shape_attention
from oasr.layers.quantized import (
    cross_attention_fp8,
    dequantize_kv_op,
    paged_decode_attention_fp8,
    quantize_kv_into,
)
from oasr.stream_cache import CAPTURE_LOCK

if TYPE_CHECKING:
    from oasr.scheduler import Request, SchedulerConfig
    from oasr.types import Transcript

__all__ = [
    "AttentionContext",
    "AutoregressiveExecutor",
    "RequestDriver",
    "Row",
    "StepModel",
    "StreamsPartials",
    "Window",
]

log = logging.getLogger(__name__)

_UIDS = itertools.count()

Finished = list[tuple["Request", "Transcript | BaseException"]]


# --------------------------------------------------------------------------- what a family supplies
class StepModel(Protocol):
    """The network half: an encoder and a decoder that runs over the executor's paged cache."""

    device: torch.device
    dtype: torch.dtype
    num_layers: int  # decoder layers with a self-attention KV cache
    num_kv_heads: int  # key/value heads stored per layer (fewer than the query heads: GQA)
    head_dim: int
    max_positions: int  # the decoder's context length (prompt + sampled tokens)
    vocab_size: int
    #: per-row cross-attention memory (frames, width) per layer, or None without cross-attention
    cross_shape: tuple[int, int] | None
    #: optional: the heads the cross-attention K/V split into (width = heads x head size); read
    #: by the fp8 cross pools (one scale per frame and head) and ``ctx.cross_attention``.
    #: Default ``num_kv_heads``
    cross_heads: int
    #: device memory the step model holds beyond the executor's pools (e.g. fused weights)
    extra_bytes: int

    def encode(self, inputs: torch.Tensor) -> torch.Tensor:
        """Encoder features (B, frames, d) of a batch of encoder inputs."""
        ...

    def project_cross(self, layer: int, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K and V (B, frames, width) of ``layer`` for ``features``; only called
        when ``cross_shape`` is set."""
        ...

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """Logits (B, T, V) for ``tokens``/``positions`` (B, T); self-attention goes through
        ``ctx.self_attention`` (it writes the new K/V into the paged cache), cross-attention
        goes through ``ctx.cross_attention`` (or reads ``ctx.cross_kv``). ``positions`` are
        absolute (rotary embeddings read them). A family whose prompts carry embeddings
        (``Window.embeds``) passes its token embeddings through ``ctx.input_embeddings`` before
        the first layer."""
        ...


class RequestDriver(Protocol):
    """The request half: what a request is made of and what happens as its windows finish.

    The driver calls back into the executor: ``executor.encode_later(window)`` (queue a window
    for encoding), ``executor.decode_later(window)`` (a window with features and a prompt, ready
    for a row) and ``executor.finish(request, result_or_error)``. A driver that fails one
    request calls ``finish`` with its error; an exception escaping a driver call fails every
    request that call was about."""

    def accept(self, request: Request) -> bool:
        """Validate ``request`` (typed errors fail it alone). False: it runs on the batch path
        (``model.transcribe``) instead."""
        ...

    def begin(self, requests: list[Request], executor: AutoregressiveExecutor) -> None:
        """The requests admitted since the last step, in one batch: queue their first windows.
        Work that may be long (a scan of the whole input) is done a bounded slice per step: the
        driver hands the requests not done yet back with ``executor.begin_later(request)``."""
        ...

    def encoder_inputs(self, windows: list[Window]) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The encoder input of each window, stacked, on the step model's device and dtype (a
        tensor, or a tuple of tensors that ``StepModel.encode`` takes as one argument)."""
        ...

    def encoded(self, windows: list[Window], features: torch.Tensor,
                executor: AutoregressiveExecutor) -> None:  # fmt: skip
        """``features`` (B, frames, d) of ``windows``: set ``window.features`` and the prompt
        and budget, then ``decode_later`` (or queue another encoding, or finish)."""
        ...

    def prefilled(self, rows: list[Row], logits: torch.Tensor) -> None:
        """The prefill logits (B, T, V) of rows that share a prompt length (before sampling)."""
        ...

    def process_logits(self, logits: torch.Tensor, rows: list[Row]) -> None:
        """Apply the family's rules to the next-token logits (B, V) of ``rows``, in place."""
        ...

    def finished(self, row: Row, executor: AutoregressiveExecutor) -> None:
        """``row`` stopped (stop token, budget or context end); its blocks are already free."""
        ...

    def release(self, request: Request) -> None:
        """Forget ``request`` (it finished or was aborted)."""
        ...


@runtime_checkable
class StreamsPartials(Protocol):
    """A driver that turns a row's tokens into text as they are sampled (token-streaming
    partials). After every sampling step the executor calls :meth:`partial` for the rows whose
    request has an ``on_partial`` callback (``Request.on_partial``)."""

    def partial(self, row: Row) -> None:
        """Call ``row.window.request.on_partial(new_text)`` if ``row``'s text grew."""
        ...


# --------------------------------------------------------------------------- bookkeeping
@dataclass(eq=False)
class Window:
    """One unit of decoding (see the module docstring). The driver fills everything but
    ``request``; ``state`` and ``info`` are the driver's own."""

    request: Request
    state: Any = None
    info: Any = None
    features: torch.Tensor | None = None  # (1, frames, d)
    prompt: list[int] = field(default_factory=list)
    sample_len: int = 0
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    suppress: tuple[int, ...] = ()  # masked at every step
    begin_suppress: tuple[int, ...] = ()  # masked at the first sampled token only
    stop_tokens: tuple[int, ...] = ()
    #: ``transformers``' repetition penalty over the prompt and the sampled tokens (1: none)
    repetition_penalty: float = 1.0
    #: seed of the row's own random generator (sampling reproducible whatever shares the batch)
    seed: int | None = None
    #: decoder inputs given as vectors: (prompt positions (n,), embeddings (n, d)) replace the
    #: token embeddings there in the prefill (a speech-LLM's audio in place of its placeholders)
    embeds: tuple[Sequence[int], torch.Tensor] | None = None


@dataclass(eq=False)
class Row:
    """A window being decoded: its KV blocks and what it sampled so far."""

    window: Window
    blocks: list[int]
    prompt_len: int
    sampled: list[int] = field(default_factory=list)
    #: float32 sum of the sampled tokens' log-probabilities, added in sampling order
    sum_logprob: Any = None
    suppress_mask: torch.Tensor | None = None  # (V,) bool
    begin_mask: torch.Tensor | None = None  # (V,) bool, or None
    seen: torch.Tensor | None = None  # (V,) bool: tokens in the sequence (repetition penalty)
    generator: torch.Generator | None = None  # the window's seeded generator
    uid: int = field(default_factory=lambda: next(_UIDS))

    @property
    def length(self) -> int:  # tokens in the cache after this step's write
        return self.prompt_len + len(self.sampled)


class AttentionContext:
    """What a step model's layers need to attend over the paged cache in one forward call."""

    def __init__(self, executor: AutoregressiveExecutor, positions: torch.Tensor, slots: torch.Tensor,
                 tables: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor | int,
                 fixed_shapes: bool = False) -> None:  # fmt: skip
        self._ex = executor
        self.positions = positions  # (B, T)
        self.slots = slots.reshape(-1)  # (B*T,) flat cache slots of the new tokens
        self.tables = tables  # (B, nb) block ids
        self.lengths = lengths  # (B,) keys valid after this call's write
        self.rows = rows  # cross-pool rows: an int n for rows [0, n), or indices (B,)
        #: this call's shapes recur (a captured graph's bucket): cross-attention may take cuDNN,
        #: whose one-off plan per shape then pays. Prefills and eager steps see a new batch size
        #: almost every call, where each plan cost milliseconds of CPU (H200, tiny.en on 1000
        #: files: prefills took 3.9 s of 7.2 s of scheduler time) and flash has no plan
        self.fixed_shapes = fixed_shapes
        #: embeddings given for some inputs: (flat indices into B*T, vectors (n, d)), or None
        self.embeds: tuple[torch.Tensor, torch.Tensor] | None = None

    def input_embeddings(self, x: torch.Tensor) -> torch.Tensor:
        """The decoder inputs ``x`` (B, T, d) (token embeddings) with the given embeddings in
        place (``Window.embeds``; prefill only, so the captured decode step never has any)."""
        if self.embeds is None:
            return x
        index, values = self.embeds
        b, t, d = x.shape
        out = x.reshape(b * t, d).clone()
        store_rows(out, index, values.to(x.dtype))
        return out.view(b, t, d)

    def self_attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``/``v`` (B, T, kv_heads * head_dim) in the cache, attend with ``q``
        (B, heads, T, head_dim) over every cached key of the row up to its position; returns
        (B, heads, T, head_dim). ``heads`` may be a multiple of ``kv_heads`` (grouped-query
        attention: only the kv heads are stored). A decode step (T = 1) reads the blocks in
        place."""
        ex = self._ex
        cache = ex.cache
        b, t = self.positions.shape
        cache.write(layer, self.slots, k.reshape(b * t, cache.num_heads, cache.head_dim),
                    v.reshape(b * t, cache.num_heads, cache.head_dim))  # fmt: skip
        if cache.fp8:  # fp8 KV cache (EngineConfig.kv_cache_dtype): the pools hold e4m3 bytes
            if t == 1:
                return paged_decode_attention_fp8(q, cache.k[layer], cache.v[layer], cache.k_scale[layer],
                                                  cache.v_scale[layer], self.tables, self.lengths)  # fmt: skip
            k_pool, v_pool, tables = cache.dequantized_blocks(layer, self.tables)
            return paged_prefill_attention(q, k_pool, v_pool, tables, self.lengths)
        if t > 1:
            # a prefill from position 0 (``_start_ready``): causal attention over the new
            # keys/values as computed (flash / cuDNN), not read back from the pools. ``q`` may
            # hold only the last positions' queries.
            return _causal_attention(q, k.reshape(b, t, cache.num_heads, cache.head_dim),
                                     v.reshape(b, t, cache.num_heads, cache.head_dim))  # fmt: skip
        return paged_decode_attention(q, cache.k[layer], cache.v[layer], self.tables, self.lengths)

    def cross_attention(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` (B, heads, T, head_dim) over this batch's rows of the
        cross-attention K/V of ``layer`` (every frame); returns (B, heads, T, head_dim). With the
        fp8 pools (``kv_cache_dtype="fp8"``) this is the op ``cross_attention_fp8``, which reads
        the e4m3 bytes and their scales (oasr-kernels on CUDA)."""
        ex = self._ex
        # the key length is always the encoder's: in a graph step (fixed_shapes) cuDNN's kernel
        # streams the K/V of a large batch about twice as fast as flash (fixed_shape_attention)
        with fixed_shape_attention() if self.fixed_shapes else nullcontext():
            if ex.cross_fp8:
                k, v, ks, vs = (self._rows_of(t[layer]) for t in (ex.cross_k, ex.cross_v, ex.cross_k_scale,
                                                                  ex.cross_v_scale))  # fmt: skip
                return cross_attention_fp8(q, k, v, ks, vs)
            k, v = self.cross_kv(layer)
            b, s, _ = k.shape
            k = k.view(b, s, ex.cross_heads, -1).transpose(1, 2)
            v = v.view(b, s, ex.cross_heads, -1).transpose(1, 2)
            return attention(q, k, v)

    def cross_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This batch's rows of the cross-attention pools of ``layer``: K, V (B, frames, width),
        in the compute dtype (the fp8 pools dequantized: ``cross_attention`` reads them
        without that copy)."""
        ex = self._ex
        if ex.cross_fp8:
            k, v, ks, vs = (self._rows_of(t[layer]) for t in (ex.cross_k, ex.cross_v, ex.cross_k_scale,
                                                              ex.cross_v_scale))  # fmt: skip
            b, h, s, d = k.shape
            return tuple(dequantize_kv_op(x, sx, ex.dtype).transpose(1, 2).reshape(b, s, h * d)
                         for x, sx in ((k, ks), (v, vs)))  # type: ignore[return-value]  # fmt: skip
        return self._rows_of(ex.cross_k[layer]), self._rows_of(ex.cross_v[layer])

    def _rows_of(self, pool: torch.Tensor) -> torch.Tensor:
        if isinstance(self.rows, int):
            return pool[: self.rows]
        return pool.index_select(0, self.rows)


#: prefills whose attention is at least this big (batch x heads x prompt tokens^2) attend
#: with cuDNN's SDPA first: its Hopper kernel runs a long causal prefill about twice as fast as
#: flash (32 Qwen2-Audio 7B prompts of 770 tokens, 1.2 ms per layer with flash on an H200), and
#: at this size that saving outweighs its one-off plan per new shape (a few ms of CPU). Smaller
#: prefills (Whisper's, one or a few Qwen requests) keep flash: no plan
CUDNN_PREFILL_WORK = 1 << 28


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention of ``q`` (B, H, Tq, D) over ``k``/``v`` (B, T, H_kv, D), query
    head ``h`` reading key/value head ``h // (H // H_kv)``: a whole prompt's attention as one
    fused SDPA call (a paged kernel re-reading the pools is slow for long prompts). ``Tq`` may
    be less than ``T``: the queries of the last ``Tq`` positions (a model that reads only the
    last hidden state), each seeing the keys up to its own position."""
    h, hkv = q.shape[1], k.shape[2]
    tq, t = q.shape[2], k.shape[1]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if hkv != h:  # grouped-query attention: each key/value head serves H / H_kv query heads
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    if tq == t:
        big = q.shape[0] * h * t * t >= CUDNN_PREFILL_WORK
        with fixed_shape_attention() if big else nullcontext():
            return attention(q, k, v, is_causal=True)
    # the last tq positions: query i sees keys 0 .. t - tq + i (none masked for the last one)
    mask = None if tq == 1 else torch.ones(tq, t, dtype=torch.bool, device=q.device).tril(t - tq)
    return attention(q, k, v, mask=mask)


class _Graph:
    """One captured decode step for a (batch, gathered blocks) shape."""

    def __init__(self, b: int, nb: int, device: torch.device) -> None:
        self.b, self.nb = b, nb
        self.tokens = torch.zeros(b, dtype=torch.long, device=device)
        self.positions = torch.zeros(b, dtype=torch.long, device=device)
        self.slots = torch.zeros(b, dtype=torch.long, device=device)
        self.tables = torch.zeros(b, nb, dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits: torch.Tensor | None = None
        #: the rows (uids) whose block tables ``tables`` holds: a row's blocks are reserved when
        #: it starts and never change, so the same rows need no new copy
        self.table_rows: tuple[int, ...] | None = None


GRAPH_BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
#: most steps the admission-group rule holds a request back while rows decode (see try_admit)
GROUP_WAIT_STEPS = 32


# --------------------------------------------------------------------------- the executor
class AutoregressiveExecutor:
    """The :class:`oasr.scheduler.Executor` for autoregressive decoders (module docstring).

    ``model`` is the :class:`~oasr.model.ASRModel` (its ``transcribe`` serves the batch path),
    ``step_model`` and ``driver`` the family's halves; ``config`` the scheduler's config, whose
    ``kv_cache_bytes``, ``block_size``, ``cuda_graphs``, ``max_encoder_batch``,
    ``min_admit_group`` and ``encoder_lookahead`` this executor reads."""

    def __init__(self, model: Any, step_model: StepModel, driver: RequestDriver,
                 config: SchedulerConfig) -> None:  # fmt: skip
        from oasr.scheduler import BatchExecutor

        self.model = model
        self.step_model = sm = step_model
        self.driver = driver
        self._partials = isinstance(driver, StreamsPartials)
        self.config = config
        self.device = torch.device(sm.device)
        self.dtype = sm.dtype
        self.block_size = config.block_size
        self.max_positions = sm.max_positions
        esize = torch.empty(0, dtype=self.dtype).element_size()
        #: "fp8": the self-attention pools and the cross-attention K/V in float8 e4m3
        #: (SchedulerConfig.kv_cache_dtype)
        self.kv_cache_dtype = config.kv_cache_dtype
        #: OASR_FP8_CROSS_KV=0 keeps the cross-attention K/V in the compute dtype (fp8 self-attention
        #: pools only), for A/B runs of the fp8 cross pools
        self.cross_fp8 = (self.kv_cache_dtype == "fp8" and sm.cross_shape is not None
                          and os.environ.get("OASR_FP8_CROSS_KV", "1") != "0")  # fmt: skip
        #: heads of the cross-attention K/V (StepModel.cross_heads)
        self.cross_heads = int(getattr(sm, "cross_heads", sm.num_kv_heads))
        cross_bytes = 0
        if sm.cross_shape is not None:
            frames, width = sm.cross_shape
            if width % self.cross_heads:
                raise ValueError(f"cross-attention width {width} does not split into {self.cross_heads} heads")
            # fp8: a byte per element and a float32 scale per (frame, head)
            per_frame = width + 4 * self.cross_heads if self.cross_fp8 else width * esize
            cross_bytes = 2 * sm.num_layers * frames * per_frame
        block_bytes = PagedKVCache.bytes_per_block(sm.num_layers, self.block_size, sm.num_kv_heads,
                                                   sm.head_dim, esize, self.kv_cache_dtype)  # fmt: skip
        self.max_blocks = blocks_for(sm.max_positions, self.block_size)
        full_seq = self.max_blocks * block_bytes
        rows = config.max_batch_size
        if config.kv_cache_bytes is None:
            num_blocks = rows * self.max_blocks + 1
        else:
            budget = int(config.kv_cache_bytes)
            if budget < cross_bytes + full_seq:
                raise InvalidRequestError(
                    f"kv_cache_bytes={budget} cannot hold one sequence of {model.name} "
                    f"({cross_bytes + full_seq} bytes: cross-attention K/V + a full decoder context)",
                    param="kv_cache_bytes",
                )
            rows = min(rows, budget // (cross_bytes + block_bytes))
            num_blocks = (budget - rows * cross_bytes) // block_bytes + 1
            num_blocks = min(num_blocks, rows * self.max_blocks + 1)
        self.max_rows = max(1, rows)
        lookahead = config.encoder_lookahead
        if lookahead is None:
            lookahead = self.max_rows if self.device.type == "cuda" else 0
        #: windows encoded ahead while every row is busy
        self.encoder_lookahead = max(0, int(lookahead))
        #: the most requests holding state at once (preparing, encoded and waiting, decoding)
        self.max_requests = config.max_batch_size + self.encoder_lookahead
        # While requests run, admit only once this many can join at once: one driver.begin, one
        # encoder batch and one prefill then serve several requests. With windows encoded ahead,
        # rows refill from those, so admission can wait for half the look-ahead; without, for
        # an eighth of the rows.
        group = config.min_admit_group
        if group is None:
            group = self.encoder_lookahead // 2 if self.encoder_lookahead else self.max_rows // 8
        self.min_admit_group = max(1, int(group))
        self._group_open = False
        #: the step at which the group rule first held a request back (None: it holds nothing)
        self._held_since: int | None = None
        self._holding = False
        #: the last try_admit refused for a reason that holds for every request (read by the
        #: scheduler, which then stops its admission round)
        self.refuses_all = False
        self.cache = PagedKVCache(sm.num_layers, int(num_blocks), self.block_size, sm.num_kv_heads,
                                  sm.head_dim, device=self.device, dtype=self.dtype,
                                  zero_on_allocate=self.device.type == "cpu",
                                  kv_dtype=self.kv_cache_dtype)  # fmt: skip
        self.cross_k: list[torch.Tensor] = []
        self.cross_v: list[torch.Tensor] = []
        #: fp8 pools only: float32 scales (rows, heads, frames), one per key / value vector
        self.cross_k_scale: list[torch.Tensor] = []
        self.cross_v_scale: list[torch.Tensor] = []
        if sm.cross_shape is not None:
            frames, width = sm.cross_shape
            # (rows, frames, width): the projection's own layout, so a window's K/V lands with
            # one contiguous copy. fp8: e4m3 bytes (rows, heads, frames, head_dim), so the
            # attention of a (row, head) reads one contiguous run of bytes and of scales
            fp8_shape = (self.max_rows, self.cross_heads, frames, width // self.cross_heads)
            shape = fp8_shape if self.cross_fp8 else (self.max_rows, frames, width)
            kw = {"device": self.device, "dtype": torch.uint8 if self.cross_fp8 else self.dtype}
            # CPU: left unwritten. A row's slot is written whole before the row reads it, and
            # the pages of slots never used stay untouched, so a run of a few inputs does not
            # hold max_batch_size windows of K/V (tiny.en: 18 MB each) in memory. CUDA graphs
            # read the padding rows too: zeros there.
            alloc = torch.zeros if self.device.type == "cuda" else torch.empty
            self.cross_k = [alloc(shape, **kw) for _ in range(sm.num_layers)]
            self.cross_v = [alloc(shape, **kw) for _ in range(sm.num_layers)]
            if self.cross_fp8:
                skw = {"device": self.device, "dtype": torch.float32}
                self.cross_k_scale = [alloc(fp8_shape[:3], **skw) for _ in range(sm.num_layers)]
                self.cross_v_scale = [alloc(fp8_shape[:3], **skw) for _ in range(sm.num_layers)]
        cross_pools = (*self.cross_k, *self.cross_v, *self.cross_k_scale, *self.cross_v_scale)
        self.memory_bytes = self.cache.nbytes + sum(t.numel() * t.element_size() for t in cross_pools)
        self.memory_bytes += int(sm.extra_bytes)
        # kernel providers (oasr-kernels: paged decode attention) for models built without
        # load_model, e.g. from an in-memory checkpoint
        install_kernel_providers(self.device.type)
        self.active: dict[str, Request] = {}  # admitted requests run here
        self.rows: list[Row] = []  # decoding, dense: row i uses cross slot i
        self.to_begin: list[Request] = []
        self.to_encode: list[Window] = []
        self.ready: list[Window] = []  # encoded, waiting for a row and KV blocks
        self.batch_path = BatchExecutor(model, config.max_batch_size)
        # an encoder batch running on the side stream: (done event, its windows, features)
        self._encoding: tuple[Any, list[Window], torch.Tensor] | None = None
        self._enc_stream = (torch.cuda.Stream(self.device)
                            if self.device.type == "cuda" and self.encoder_lookahead else None)  # fmt: skip
        use_graphs = config.cuda_graphs
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else bool(use_graphs)
        if self.device.type != "cuda":
            self.use_graphs = False
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._sup_key: tuple | None = None
        self._sup: torch.Tensor | None = None
        self._no_suppress: torch.Tensor | None = None  # the mask of a row without suppressed tokens
        self.graph_batch_sizes = sorted({b for b in GRAPH_BATCH_SIZES if b < self.max_rows} | {self.max_rows})
        self._done: Finished = []
        self.stats = {"steps": 0, "graph_replays": 0, "eager_steps": 0, "max_rows": 0,
                      "tokens": 0, "overlapped_encodes": 0}  # fmt: skip

    # ------------------------------------------------------------------ Executor protocol
    @property
    def num_running(self) -> int:
        return len(self.active) + self.batch_path.num_running

    def try_admit(self, request: Request) -> bool:
        free = self.max_requests - self.num_running
        # a refusal below holds for any request this step: the scheduler asks no other
        self.refuses_all = True
        if free <= 0:
            return False
        if self.rows and not self._group_open and free < self.min_admit_group:
            # refill in groups (see __init__), but only while rows decode (they free the room
            # soon) and for at most GROUP_WAIT_STEPS steps: requests still being gated or
            # encoded may hold their places for long, and a short clip must not wait for them
            self._holding = True
            if self._held_since is None:
                self._held_since = self.stats["steps"]
            if self.stats["steps"] - self._held_since < GROUP_WAIT_STEPS:
                return False
        self.refuses_all = False
        continuous = self.driver.accept(request)  # typed errors fail this request alone
        self._group_open = True  # the rest of this admission round joins the group
        self._held_since = None
        if not continuous:
            return self.batch_path.try_admit(request)
        self.active[request.rid] = request
        self.to_begin.append(request)
        return True

    def abort(self, request: Request) -> bool:
        if self.batch_path.abort(request):
            return True
        if self.active.pop(request.rid, None) is None:
            return False
        if request in self.to_begin:
            self.to_begin.remove(request)
        self.to_encode = [w for w in self.to_encode if w.request is not request]
        self.ready = [w for w in self.ready if w.request is not request]
        for i in range(len(self.rows) - 1, -1, -1):
            if self.rows[i].window.request is request:
                self._drop_row(i)
        self.driver.release(request)
        return True

    def step(self) -> Finished:
        self._done = done = []
        self._group_open = False
        if not self._holding:  # nothing was held back this round: the wait starts afresh
            self._held_since = None
        self._holding = False
        self.stats["steps"] += 1
        if self.batch_path.num_running:
            done.extend(self.batch_path.step())
        with torch.inference_mode():
            if self.to_begin:
                self._begin()
            self._collect_encoded()
            self._encode_pending()
            self._start_ready()
            if self.rows:
                self._decode_step()
        return done

    # ------------------------------------------------------------------ driver callbacks
    def alive(self, request: Request) -> bool:
        return request.rid in self.active

    def begin_later(self, request: Request) -> None:
        """Hand ``request`` to :meth:`RequestDriver.begin` again at the next step (a driver
        whose admission work, e.g. a VAD scan, goes on over several steps)."""
        if self.alive(request):
            self.to_begin.append(request)

    def encode_later(self, window: Window) -> None:
        """Queue ``window`` for the next encoder batch."""
        self.to_encode.append(window)

    def decode_later(self, window: Window) -> None:
        """``window`` has features and a prompt: start it when a row and its blocks are free."""
        if len(window.prompt) + 1 > self.max_positions:
            self.finish(window.request, InvalidRequestError(
                f"the prompt is {len(window.prompt)} tokens; the decoder holds {self.max_positions}",
                param="prompt",
            ))  # fmt: skip
            return
        self.ready.append(window)

    def finish(self, request: Request, result: Transcript | BaseException) -> None:
        """``request`` is done: its result (or error) goes back to the scheduler."""
        if self.active.pop(request.rid, None) is None:
            return  # aborted, or already failed
        self.driver.release(request)
        self._done.append((request, result))

    def _fail_all(self, windows_or_requests: Sequence[Any], exc: BaseException) -> None:
        for x in windows_or_requests:
            self.finish(x.request if isinstance(x, Window) else x, exc)

    # ------------------------------------------------------------------ encoder
    def _begin(self) -> None:
        batch, self.to_begin = self.to_begin, []
        try:
            self.driver.begin(batch, self)
        except Exception as exc:  # noqa: BLE001 - the driver could not start them
            self._fail_all(batch, exc)

    def _encode_pending(self) -> None:
        if not self.to_encode or self._encoding is not None:
            return
        limit = self.config.max_encoder_batch or self.config.max_batch_size
        batch, self.to_encode = self.to_encode[:limit], self.to_encode[limit:]
        # while rows decode, encode on the side stream and pick the result up in a later step;
        # with no row running there is nothing to overlap with
        overlap = self._enc_stream is not None and bool(self.rows)
        try:
            inputs = self.driver.encoder_inputs(batch)
            if overlap:
                main = torch.cuda.current_stream(self.device)
                self._enc_stream.wait_stream(main)  # the inputs come from the main stream
                with torch.cuda.stream(self._enc_stream):
                    feats = self.step_model.encode(inputs)
                    event = torch.cuda.Event()
                    event.record()
                # tell the allocator which stream uses what, so no block is reused early
                for x in inputs if isinstance(inputs, tuple) else (inputs,):
                    x.record_stream(self._enc_stream)
                feats.record_stream(main)
                self._encoding = (event, batch, feats)
                self.stats["overlapped_encodes"] += 1
                return
            feats = self.step_model.encode(inputs)
        except Exception:  # noqa: BLE001 - isolate: encode one by one
            for w in batch:
                try:
                    self._encoded([w], self.step_model.encode(self.driver.encoder_inputs([w])))
                except Exception as exc:  # noqa: BLE001
                    self.finish(w.request, exc)
            return
        self._encoded(batch, feats)

    def _collect_encoded(self) -> None:
        """Take the side stream's encoder batch once it is done; wait for it only when nothing
        else is left to run."""
        if self._encoding is None:
            return
        event, batch, feats = self._encoding
        if not event.query() and (self.rows or self.ready):
            return
        self._encoding = None
        torch.cuda.current_stream(self.device).wait_event(event)
        self._encoded(batch, feats)

    def _encoded(self, batch: list[Window], feats: torch.Tensor) -> None:
        live = [k for k, w in enumerate(batch) if self.alive(w.request)]  # not aborted
        if not live:
            return
        if len(live) < len(batch):
            batch, feats = [batch[k] for k in live], feats[live]
        try:
            self.driver.encoded(batch, feats, self)
        except Exception as exc:  # noqa: BLE001
            self._fail_all(batch, exc)

    # ------------------------------------------------------------------ starting windows
    def _start_ready(self) -> None:
        starting: list[Row] = []
        keep: list[Window] = []
        for w in self.ready:
            if not self.alive(w.request):
                continue
            if len(self.rows) + len(starting) >= self.max_rows:
                keep.append(w)
                continue
            need = blocks_for(min(len(w.prompt) + w.sample_len, self.max_positions), self.block_size)
            if not self.cache.allocator.can_allocate(need):
                keep.append(w)
                continue
            row = Row(w, self.cache.allocate(need), len(w.prompt))
            self._row_masks(row)
            starting.append(row)
        self.ready = keep
        if not starting:
            return
        base = len(self.rows)
        if self.cross_k:  # cross-attention K/V once per window, straight into the rows' slots
            feats = torch.cat([r.window.features for r in starting]).to(self.device, self.dtype)
            for li in range(len(self.cross_k)):
                k, v = self.step_model.project_cross(li, feats)
                self._store_cross(li, slice(base, base + len(starting)), k, v)
        self.rows.extend(starting)
        self.stats["max_rows"] = max(self.stats["max_rows"], len(self.rows))
        by_len: dict[int, list[int]] = {}
        for i in range(base, len(self.rows)):
            by_len.setdefault(self.rows[i].prompt_len, []).append(i)
        finished: list[int] = []
        for t, idx in by_len.items():  # prefill, grouped by prompt length
            rows = [self.rows[i] for i in idx]
            tokens = torch.tensor([r.window.prompt for r in rows], dtype=torch.long, device=self.device)
            positions = torch.arange(t, device=self.device).expand(len(rows), t)
            tables = self._tables(rows, blocks_for(t, self.block_size))
            slots = self._slot_ids(tables, positions)
            lengths = torch.full((len(rows),), t, dtype=torch.long, device=self.device)
            ctx = AttentionContext(self, positions, slots, tables, lengths, torch.tensor(idx, device=self.device))
            ctx.embeds = self._prompt_embeds(rows, t)
            logits = self.step_model.forward(tokens, positions, ctx)
            self.driver.prefilled(rows, logits)
            last = logits[:, -1].float().clone()
            for r in rows:
                r.sum_logprob = np.float32(0.0)
            finished.extend(self._sample(rows, idx, last))
        self._retire(finished)

    def _store_cross(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the cross-attention K/V (n, frames, width) of ``layer`` into pool ``rows``;
        quantized once here per (frame, head) with the fp8 pools."""
        if not self.cross_fp8:
            self.cross_k[layer][rows].copy_(k)
            self.cross_v[layer][rows].copy_(v)
            return
        n, frames, width = k.shape
        for pool, scales, x in ((self.cross_k, self.cross_k_scale, k), (self.cross_v, self.cross_v_scale, v)):
            # (n, frames, heads, d) quantized straight into the (rows, heads, frames, d) pool
            quantize_kv_into(x.reshape(n, frames, self.cross_heads, width // self.cross_heads),
                             pool[layer][rows].transpose(1, 2), scales[layer][rows].transpose(1, 2))  # fmt: skip

    def _prompt_embeds(self, rows: list[Row], t: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The windows' given embeddings as (flat indices into the (B, T) prefill, vectors)."""
        index: list[int] = []
        values: list[torch.Tensor] = []
        for k, r in enumerate(rows):
            if r.window.embeds is None:
                continue
            pos, vec = r.window.embeds
            pos = [int(p) for p in pos]
            if len(pos) != vec.shape[0] or any(not 0 <= p < t for p in pos):
                raise ValueError(f"{len(pos)} embedding positions for {vec.shape[0]} vectors in a prompt of {t}")
            index.extend(k * t + p for p in pos)
            values.append(vec.to(self.device))
        if not values:
            return None
        return torch.tensor(index, dtype=torch.long, device=self.device), torch.cat(values)

    def _row_masks(self, row: Row) -> None:
        w = row.window
        v = self.step_model.vocab_size
        if w.repetition_penalty != 1.0:
            seen = torch.zeros(v, dtype=torch.bool, device=self.device)
            ids = [t for t in w.prompt if 0 <= t < v]
            if ids:
                seen[torch.tensor(ids, device=self.device)] = True
            row.seen = seen
        if w.seed is not None and w.temperature > 0:
            row.generator = torch.Generator(device=self.device)
            row.generator.manual_seed(int(w.seed))
        ids = [t for t in w.suppress if 0 <= t < v]
        if ids:  # rows without suppressed tokens keep None: a step where none has any masks nothing
            sup = torch.zeros(v, dtype=torch.bool, device=self.device)
            sup[torch.tensor(ids, device=self.device)] = True
            row.suppress_mask = sup
        if w.begin_suppress:
            begin = torch.zeros(v, dtype=torch.bool, device=self.device)
            begin[torch.tensor([t for t in w.begin_suppress if 0 <= t < v], device=self.device)] = True
            row.begin_mask = begin

    # ------------------------------------------------------------------ the decoder
    def _tables(self, rows: Sequence[Row], nb: int) -> torch.Tensor:
        return torch.tensor([(r.blocks + [0] * nb)[:nb] for r in rows], dtype=torch.long, device=self.device)

    def _slot_ids(self, tables: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return tables.gather(1, positions // bs) * bs + positions % bs

    def _decode_step(self) -> None:
        # rows that were prefilled this step already sampled; every row advances by one token
        n = len(self.rows)
        rows = self.rows
        need = max(blocks_for(r.length, self.block_size) for r in rows)
        tokens = [r.sampled[-1] for r in rows]
        positions = [r.length - 1 for r in rows]
        if self.use_graphs:
            logits = self._graph_step(rows, tokens, positions, need)
        else:
            self.stats["eager_steps"] += 1
            tables = self._tables(rows, need)
            pos = torch.tensor(positions, dtype=torch.long, device=self.device)[:, None]
            tok = torch.tensor(tokens, dtype=torch.long, device=self.device)[:, None]
            ctx = AttentionContext(self, pos, self._slot_ids(tables, pos), tables, pos[:, 0] + 1, n)
            logits = self.step_model.forward(tok, pos, ctx)[:, -1]
        finished = self._sample(rows, list(range(n)), logits[:n].float())
        self._retire(finished)

    def _graph_for(self, n: int, need: int) -> _Graph:
        b = next(x for x in self.graph_batch_sizes if x >= n)
        nb = 1
        while nb < need:
            nb *= 2
        nb = min(nb, self.max_blocks)
        g = self._graphs.get((b, nb))
        if g is not None:
            return g
        g = _Graph(b, nb, self.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()

        def run() -> torch.Tensor:
            pos = g.positions[:, None]
            ctx = AttentionContext(self, pos, g.slots[:, None], g.tables, pos[:, 0] + 1, b, fixed_shapes=True)
            return self.step_model.forward(g.tokens[:, None], pos, ctx)[:, -1]

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # one capture at a time in the process, not invalidated by other threads' device work
        # (oasr.stream_cache.GraphSteps says why)
        with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            g.logits = run()
        g.graph = graph
        self._graphs[(b, nb)] = g
        return g

    def _graph_step(self, rows: list[Row], tokens: list[int], positions: list[int], need: int) -> torch.Tensor:
        n = len(rows)
        g = self._graph_for(n, need)
        bs = self.block_size
        pad = g.b - n
        # padding rows: position 0 of the scratch block 0
        slots = [r.blocks[p // bs] * bs + p % bs for r, p in zip(rows, positions, strict=True)] + [0] * pad
        host = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots], dtype=torch.long)
        dev = host.to(self.device, non_blocking=True)
        g.tokens.copy_(dev[0])
        g.positions.copy_(dev[1])
        g.slots.copy_(dev[2])
        uids = tuple(r.uid for r in rows)
        if g.table_rows != uids:  # most steps decode the same rows as the last one
            tab = [(r.blocks + [0] * g.nb)[: g.nb] for r in rows] + [[0] * g.nb] * pad
            g.tables.copy_(torch.tensor(tab, dtype=torch.long).to(self.device, non_blocking=True))
            g.table_rows = uids
        g.graph.replay()
        self.stats["graph_replays"] += 1
        assert g.logits is not None
        return g.logits

    # ------------------------------------------------------------------ sampling
    def _sample(self, rows: list[Row], idx: list[int], logits: torch.Tensor) -> list[int]:
        """Filter ``logits`` (B, V) per row, pick each row's next token; return the indices
        (into ``self.rows``) of the rows that finished."""
        b = logits.shape[0]
        dev = self.device
        penal = [i for i, r in enumerate(rows) if r.seen is not None]
        if penal:
            self._penalize(logits, [rows[i] for i in penal], penal)
        begin_rows = [i for i, r in enumerate(rows) if r.begin_mask is not None and not r.sampled]
        sup: torch.Tensor | None = None
        if begin_rows:
            sup = torch.stack([self._suppress_mask(r) for r in rows])
            br = torch.tensor(begin_rows, device=dev)
            sup[br] |= torch.stack([rows[i].begin_mask for i in begin_rows])
        elif any(r.suppress_mask is not None for r in rows):  # the same rows as last step: reuse
            key = tuple(r.uid for r in rows)
            if self._sup_key != key:
                self._sup_key, self._sup = key, torch.stack([self._suppress_mask(r) for r in rows])
            sup = self._sup
        if sup is not None:
            logits.masked_fill_(sup, -math.inf)
        self.driver.process_logits(logits, rows)
        next_tokens = logits.argmax(dim=-1)
        hot = [i for i, r in enumerate(rows) if r.window.temperature > 0]
        if hot:
            next_tokens[hot] = self._draw(logits[hot], [rows[i].window for i in hot],
                                          [rows[i].generator for i in hot])  # fmt: skip
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        picked = logprobs[torch.arange(b, device=dev), next_tokens]
        # one device-to-host sync per step: token ids (< 2**24) and float32 log-probs are both
        # exact in float64
        if penal:
            pi = torch.tensor(penal, device=dev)
            seen = torch.stack([rows[i].seen for i in penal])
            seen[torch.arange(len(penal), device=dev), next_tokens[pi]] = True
            for k, i in enumerate(penal):
                rows[i].seen = seen[k]
        toks_f, picked_f = torch.stack((next_tokens.double(), picked.double())).tolist()
        for r, p in zip(rows, picked_f, strict=True):
            r.sum_logprob = np.float32(r.sum_logprob) + np.float32(p)
        self.stats["tokens"] += b
        finished = []
        for i, (r, t) in enumerate(zip(rows, toks_f, strict=True)):
            t = int(t)
            r.sampled.append(t)
            w = r.window
            if t in w.stop_tokens or len(r.sampled) >= w.sample_len or r.length > self.max_positions:
                finished.append(idx[i])
            elif r.length > len(r.blocks) * self.block_size:
                raise RuntimeError("KV blocks exhausted")  # cannot happen: blocks cover prompt + budget
        if self._partials:
            for r in rows:
                if r.window.request.on_partial is not None:
                    try:
                        self.driver.partial(r)  # type: ignore[attr-defined]
                    except Exception:  # noqa: BLE001 - a listener's failure is not the request's
                        log.warning("token-streaming partial failed", exc_info=True)
        return finished

    def _suppress_mask(self, row: Row) -> torch.Tensor:
        if row.suppress_mask is not None:
            return row.suppress_mask
        if self._no_suppress is None:
            self._no_suppress = torch.zeros(self.step_model.vocab_size, dtype=torch.bool, device=self.device)
        return self._no_suppress

    @staticmethod
    def _penalize(logits: torch.Tensor, rows: list[Row], idx: list[int]) -> None:
        """``transformers``' repetition penalty, in place: the logit of a token already in the
        row's sequence (prompt included) is divided by the penalty when positive, multiplied
        when negative."""
        dev = logits.device
        i = torch.tensor(idx, device=dev)
        sub = logits[i]
        seen = torch.stack([r.seen for r in rows])
        p = torch.tensor([r.window.repetition_penalty for r in rows], device=dev, dtype=sub.dtype)[:, None]
        logits[i] = torch.where(seen, torch.where(sub < 0, sub * p, sub / p), sub)

    def _draw(self, logits: torch.Tensor, windows: list[Window],
              generators: Sequence[torch.Generator | None] | None = None) -> torch.Tensor:  # fmt: skip
        """Sample one token per row at the rows' temperatures, within their top-k / top-p."""
        dev = logits.device
        temps = torch.tensor([w.temperature for w in windows], device=dev)[:, None]
        scaled = logits.float() / temps
        if any(w.top_k for w in windows):
            ks = torch.tensor([w.top_k or scaled.shape[-1] for w in windows], device=dev)
            kth = scaled.sort(dim=-1, descending=True).values.gather(1, (ks - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, -math.inf)
        if any(w.top_p is not None and w.top_p < 1.0 for w in windows):
            ps = torch.tensor([w.top_p if w.top_p is not None else 1.0 for w in windows], device=dev)
            sorted_logits, order = scaled.sort(dim=-1, descending=True)
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            # drop a token once the tokens before it already hold top_p (the best always stays)
            drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= ps[:, None]
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, -math.inf)
        probs = torch.softmax(scaled, dim=-1)
        if generators is None or all(g is None for g in generators):
            return torch.multinomial(probs, 1)[:, 0]
        # a seeded row draws from its own generator, so its tokens do not depend on its batch
        return torch.cat([torch.multinomial(probs[k : k + 1], 1, generator=g)[:, 0]
                          for k, g in enumerate(generators)])  # fmt: skip

    # ------------------------------------------------------------------ finishing rows
    def _drop_row(self, i: int) -> Row:
        """Remove row ``i``; the last row moves into its place (its cross K/V copied)."""
        row = self.rows[i]
        last = len(self.rows) - 1
        if i != last:
            for pools in (self.cross_k, self.cross_v, self.cross_k_scale, self.cross_v_scale):
                for pool in pools:
                    pool[i].copy_(pool[last])
            self.rows[i] = self.rows[last]
        self.rows.pop()
        self.cache.allocator.free(row.blocks)
        row.blocks = []
        return row

    def _retire(self, finished: list[int]) -> None:
        if not finished:
            return
        # drop from the highest row down so moved rows keep valid indices
        dropped = [self._drop_row(i) for i in sorted(set(finished), reverse=True)]
        for row in dropped:
            request = row.window.request
            if not self.alive(request):
                continue
            try:
                self.driver.finished(row, self)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                self.finish(request, exc)

"""Streaming encoder caches of all live streams in shared device pools, gathered by index.

A streaming encoder carries state from one chunk to the next: attention keys/values of the frames
it has seen (a sequence that grows by one chunk per step) and fixed-size state such as the last
inputs of causal convolutions. :class:`StreamCachePool` keeps that state for *every* live stream in
a few preallocated tensors, so one batched step over streams of different ages reads its rows with
one ``index_select`` and writes them back with one ``index_copy_``, never copying whole caches
stream by stream:

* **slot tensors** (``slots={name: (shape, dtype)}``): one entry of a fixed shape per stream, in a
  tensor ``(capacity + 1, *shape)``. A stream owns a *slot* (its row); slot 0 is a scratch row that
  padded rows of a static (CUDA-graph) batch read and write.
* **paged frames** (``frame_shape``): frames appended per chunk, stored in blocks of
  ``block_size`` frames in one tensor ``(num_blocks * block_size, *frame_shape)``. A stream's
  block table maps its logical block ``b`` (frames ``b * block_size ..``) to a physical block, as a
  ring of ``table_width`` entries: with a bounded history (``max_frames``, e.g. WeNet's
  ``chunk_size * num_left_chunks``) the blocks wholly older than the history are returned to the
  pool as the stream advances, so memory follows the history, not the stream's age. Block 0 is a
  scratch block.

The index arithmetic (which pool rows hold a batch's history, where its new frames go) is done on
the host in numpy, vectorised over the batch, from per-slot tables; the device sees one int64
index tensor per step. Memory grows by doubling when slots or blocks run out (rare, amortised;
:attr:`generation` changes so that captured CUDA graphs holding the old tensors are dropped).

:class:`StreamContext` is a stream's handle (slot, frames stored, oldest frame kept). Contexts are
released explicitly (finish, abort, disconnect) or, as a safety net, when their owner is garbage
collected (:meth:`StreamCachePool.open` with ``owner``).

Thread-safety: opening and releasing may happen from any thread (a lock guards the free lists);
releases are applied at the next :meth:`reserve`, so a step in progress never sees its blocks
handed to another stream.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from oasr.errors import EngineOverloadedError

if TYPE_CHECKING:
    import torch

__all__ = ["StepProfile", "StreamCachePool", "StreamContext"]


@dataclass(eq=False)
class StreamContext:
    """One stream's place in a :class:`StreamCachePool`."""

    slot: int
    #: frames appended so far (absolute count since the stream started)
    length: int = 0
    #: first frame still readable (frames before it were dropped by the history bound)
    start: int = 0
    released: bool = False

    @property
    def cached(self) -> int:
        """Frames readable now (``length - start``)."""
        return self.length - self.start


class StreamCachePool:
    """Per-stream slot tensors and paged frame history for all live streams (module docstring).

    ``frame_shape``/``frame_dtype``: one frame of history (WeNet: ``(layers, 2, heads, head_dim)``
    = the keys and values of every layer); None for a pool of slot tensors only. ``max_frames``:
    the most history frames a stream keeps (older frames are dropped as it advances);
    ``max_chunk_frames``: the most frames one step appends to a stream.
    ``capacity``: initial slots; ``max_streams``: the most slots ever (None: grow without bound);
    beyond it :meth:`open` raises :class:`~oasr.errors.EngineOverloadedError`.
    """

    def __init__(self, *, slots: dict[str, tuple[tuple[int, ...], Any]] | None = None,
                 frame_shape: tuple[int, ...] | None = None, frame_dtype: Any = None,
                 block_size: int = 16, max_frames: int = 4096, max_chunk_frames: int = 256,
                 device: Any = "cpu",
                 capacity: int = 8, max_streams: int | None = None) -> None:  # fmt: skip
        import torch

        if block_size < 1 or max_frames < 1 or capacity < 1:
            raise ValueError("block_size, max_frames and capacity must be >= 1")
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_frames = max_frames
        self.max_streams = max_streams
        if max_chunk_frames < 1:
            raise ValueError("max_chunk_frames must be >= 1")
        self.max_chunk_frames = max_chunk_frames
        # ring of logical blocks per stream: while a step runs a stream holds its history (at most
        # max_frames) and the frames being written (at most max_chunk_frames), each possibly
        # starting inside a block
        self.table_width = math.ceil((max_frames + max_chunk_frames) / block_size) + 2
        self._slot_specs = dict(slots or {})
        self._frame_shape = tuple(frame_shape) if frame_shape is not None else None
        self._frame_dtype = frame_dtype
        self._lock = threading.Lock()
        self._pending_free: list[StreamContext] = []
        self.generation = 0
        self.capacity = 0
        self.num_blocks = 0
        self.slot_tensors: dict[str, torch.Tensor] = {}
        self.frames: torch.Tensor | None = None
        self._free_slots: list[int] = []
        self._free_blocks: list[int] = []
        self._table = np.zeros((1, self.table_width), np.int64)
        self._live: dict[int, StreamContext] = {}
        self.stats = {"grows": 0, "max_streams": 0, "opened": 0, "released": 0}
        self._grow_slots(capacity)
        if self._frame_shape is not None:
            self._grow_blocks(capacity * max(2, math.ceil(min(max_frames, 4 * block_size) / block_size)))

    # -- memory -------------------------------------------------------------------------------
    def _grow_slots(self, capacity: int) -> None:
        import torch

        old = self.capacity
        if capacity <= old:
            return
        for name, (shape, dtype) in self._slot_specs.items():
            t = torch.zeros((capacity + 1, *shape), dtype=dtype, device=self.device)
            if old:
                t[: old + 1] = self.slot_tensors[name]
            self.slot_tensors[name] = t
        table = np.zeros((capacity + 1, self.table_width), np.int64)
        table[: old + 1] = self._table
        self._table = table
        self._free_slots.extend(range(capacity, old, -1))  # pop() hands out low ids first
        self.capacity = capacity
        self.generation += 1

    def _grow_blocks(self, num_blocks: int) -> None:
        import torch

        old = self.num_blocks
        if num_blocks <= old:
            return
        bs = self.block_size
        t = torch.zeros((num_blocks * bs, *self._frame_shape), dtype=self._frame_dtype, device=self.device)
        if old:
            t[: old * bs] = self.frames
        self.frames = t
        self._free_blocks.extend(range(num_blocks - 1, max(old, 1) - 1, -1))
        self.num_blocks = num_blocks
        self.generation += 1

    def ensure(self, streams: int, frames_per_stream: int = 0) -> None:
        """Grow now to ``streams`` slots and room for ``frames_per_stream`` history frames each
        (before capturing CUDA graphs: growing later drops them)."""
        with self._lock:
            if streams > self.capacity:
                self._grow_slots(streams)
            if self._frame_shape is not None:
                per = math.ceil(min(frames_per_stream, self.max_frames + self.max_chunk_frames) / self.block_size) + 1
                self._grow_blocks(streams * per + 1)

    @property
    def memory_bytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.slot_tensors.values())
        if self.frames is not None:
            n += self.frames.numel() * self.frames.element_size()
        return n

    # -- streams ------------------------------------------------------------------------------
    def open(self, owner: Any = None) -> StreamContext:
        """A slot for a new stream, its slot tensors zeroed. ``owner``: when it is garbage
        collected without :meth:`release`, the context is released then."""
        with self._lock:
            self._apply_pending()
            if not self._free_slots:
                live = len(self._live)
                if self.max_streams is not None and live >= self.max_streams:
                    raise EngineOverloadedError(
                        f"all {self.max_streams} streaming cache slots are in use; retry later"
                    )
                grow = 2 * self.capacity
                if self.max_streams is not None:
                    grow = min(grow, self.max_streams)
                self._grow_slots(grow)
                self.stats["grows"] += 1
            slot = self._free_slots.pop()
            ctx = StreamContext(slot)
            self._live[slot] = ctx
            self.stats["opened"] += 1
            self.stats["max_streams"] = max(self.stats["max_streams"], len(self._live))
        for t in self.slot_tensors.values():
            t[slot].zero_()
        self._table[slot] = 0
        if owner is not None:
            weakref.finalize(owner, self.release, ctx)
        return ctx

    def release(self, ctx: StreamContext) -> None:
        """Return the stream's slot and blocks (idempotent; applied at the next reserve/open)."""
        with self._lock:
            if ctx.released:
                return
            ctx.released = True
            self._pending_free.append(ctx)

    def _apply_pending(self) -> None:
        """Free the slots and blocks of released contexts (lock held)."""
        pending, self._pending_free = self._pending_free, []
        bs = self.block_size
        for ctx in pending:
            if self._live.pop(ctx.slot, None) is None:
                continue
            if self._frame_shape is not None and ctx.length > ctx.start:
                first, last = ctx.start // bs, (ctx.length - 1) // bs
                for b in range(first, last + 1):
                    self._free_blocks.append(int(self._table[ctx.slot, b % self.table_width]))
            self._table[ctx.slot] = 0
            self._free_slots.append(ctx.slot)
            self.stats["released"] += 1

    @property
    def num_streams(self) -> int:
        with self._lock:
            return len(self._live) - sum(1 for c in self._pending_free if c.slot in self._live)

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by live streams (a released stream's blocks return to the free list at
        the next open or step, but they count as free from its release)."""
        with self._lock:
            bs, pending = self.block_size, 0
            for ctx in self._pending_free:
                if ctx.slot in self._live and self._frame_shape is not None and ctx.length > ctx.start:
                    pending += (ctx.length - 1) // bs - ctx.start // bs + 1
            return max(0, self.num_blocks - 1 - len(self._free_blocks) - pending)

    def occupancy(self) -> dict[str, float]:
        """Gauges: live streams, slot capacity, blocks used / allocated, bytes allocated."""
        return {"streams": self.num_streams, "slots": self.capacity, "blocks_used": self.blocks_in_use,
                "blocks": max(0, self.num_blocks - 1), "bytes": self.memory_bytes}  # fmt: skip

    # -- one batched step ---------------------------------------------------------------------
    def reserve(self, ctxs: Sequence[StreamContext], new_frames: Sequence[int] | np.ndarray) -> None:
        """Make room for ``new_frames[i]`` more frames of ``ctxs[i]`` (allocating blocks) and
        apply pending releases. Call before :meth:`read_index` / :meth:`write_index` of a step;
        :meth:`advance` after it."""
        if self._frame_shape is None:
            with self._lock:
                self._apply_pending()
            return
        bs, w = self.block_size, self.table_width
        with self._lock:
            self._apply_pending()
            lengths = np.fromiter((c.length for c in ctxs), np.int64, len(ctxs))
            new = np.asarray(new_frames, np.int64)
            if new.size and int(new.max()) > self.max_chunk_frames:
                raise ValueError(f"{int(new.max())} new frames in one step; this pool takes at most "
                                 f"{self.max_chunk_frames} (max_chunk_frames)")
            have = -(-lengths // bs)  # blocks allocated (ceil)
            need = -(-(lengths + new) // bs)
            rows = np.nonzero(need > have)[0]
            total = int((need - have)[rows].sum()) if rows.size else 0
            if total > len(self._free_blocks):
                self._grow_blocks(max(2 * self.num_blocks, self.num_blocks + total - len(self._free_blocks) + 1))
                self.stats["grows"] += 1
            if total:  # handed out as one pop() per block would: row by row, blocks ascending
                cnt = (need - have)[rows]
                blocks = self._free_blocks[-total:][::-1]
                del self._free_blocks[-total:]
                first = np.repeat(have[rows] - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)
                slots = np.fromiter((ctxs[i].slot for i in rows.tolist()), np.int64, rows.size)
                self._table[np.repeat(slots, cnt), first % w] = blocks

    def read_index(self, ctxs: Sequence[StreamContext], width: int) -> tuple[np.ndarray, np.ndarray]:
        """Pool rows of each stream's readable history, left-aligned and padded to ``width``:
        ``(index (B, width) int64, count (B,))``; padding points at the scratch block."""
        bs, w = self.block_size, self.table_width
        b = len(ctxs)
        start = np.fromiter((c.start for c in ctxs), np.int64, b)
        count = np.fromiter((c.length - c.start for c in ctxs), np.int64, b)
        slots = np.fromiter((c.slot for c in ctxs), np.int64, b)
        f = start[:, None] + np.arange(width)[None, :]
        blocks = self._table[slots[:, None], (f // bs) % w]
        idx = blocks * bs + f % bs
        idx[np.arange(width)[None, :] >= count[:, None]] = 0
        return idx, count

    def write_index(self, ctxs: Sequence[StreamContext], new_frames: Sequence[int] | np.ndarray,
                    width: int) -> np.ndarray:  # fmt: skip
        """Pool rows for each stream's next ``new_frames[i]`` frames, padded to ``width`` (padding
        writes to the scratch block). Rows must have been :meth:`reserve`\\ d."""
        bs, w = self.block_size, self.table_width
        b = len(ctxs)
        length = np.fromiter((c.length for c in ctxs), np.int64, b)
        slots = np.fromiter((c.slot for c in ctxs), np.int64, b)
        n = np.asarray(new_frames, np.int64)
        f = length[:, None] + np.arange(width)[None, :]
        idx = self._table[slots[:, None], (f // bs) % w] * bs + f % bs
        j = np.arange(width)[None, :]
        return np.where(j >= n[:, None], j % bs, idx)  # padding: rows of the scratch block 0

    def advance(self, ctxs: Sequence[StreamContext], new_frames: Sequence[int] | np.ndarray,
                keep: Sequence[int] | np.ndarray | None = None) -> None:
        """Record ``new_frames[i]`` frames appended to ``ctxs[i]`` and drop history older than
        ``keep[i]`` frames (capped by ``max_frames``; < 0: only the cap), freeing whole blocks."""
        bs, w = self.block_size, self.table_width
        n = len(ctxs)
        length = np.fromiter((c.length for c in ctxs), np.int64, n) + np.asarray(new_frames, np.int64)
        old = np.fromiter((c.start for c in ctxs), np.int64, n)
        k = np.full(n, self.max_frames, np.int64)
        if keep is not None:
            kk = np.asarray(keep, np.int64)
            k = np.where(kk < 0, k, np.minimum(kk, k))
        start = np.maximum(old, length - k)
        for c, ln, st in zip(ctxs, length.tolist(), start.tolist(), strict=True):
            c.length, c.start = ln, st
        if self._frame_shape is None:
            return
        lo, hi = old // bs, start // bs  # blocks wholly before the new start are free
        cnt = hi - lo
        total = int(cnt.sum())
        if total:  # in stream order, blocks ascending
            slots = np.fromiter((c.slot for c in ctxs), np.int64, n)
            b = np.repeat(lo - (np.cumsum(cnt) - cnt), cnt) + np.arange(total)
            freed = self._table[np.repeat(slots, cnt), b % w].tolist()
            with self._lock:
                self._free_blocks.extend(freed)

    def slot_ids(self, ctxs: Sequence[StreamContext]) -> np.ndarray:
        return np.fromiter((c.slot for c in ctxs), np.int64, len(ctxs))


def bucket(n: int, buckets: Sequence[int]) -> int:
    """The smallest bucket >= n (n itself beyond the last)."""
    for b in buckets:
        if b >= n:
            return b
    return n


#: batch-size buckets of captured streaming steps (the autoregressive executor's, extended)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
                 1536, 2048)  # fmt: skip


#: held while a :class:`GraphSteps` captures: one CUDA-graph capture at a time in the process
CAPTURE_LOCK = threading.Lock()


class GraphSteps:
    """CUDA graphs of a fixed-shape step function, captured lazily per shape key and replayed.

    ``fn(*inputs) -> tuple of tensors``; ``dummy(key) -> inputs`` builds inputs of the key's
    shapes that touch only scratch state (a step's function may write caches: the eager warm-up
    and the capture must not advance a real stream twice). :meth:`run` copies ``inputs`` into the
    static buffers of the graph for ``key`` (capturing it on first use) and returns the graph's
    static outputs (valid until the next replay of that key). ``generation`` (e.g.
    :attr:`StreamCachePool.generation`) drops every graph when it changes: graphs hold the
    addresses of the pools they read. All graphs share one memory pool; once every graph is
    dropped, so is the pool's handle (torch's allocator forgets a pool whose graphs are all gone,
    and a capture into the dead handle fails its ``use_count > 0`` assertion).

    Captures may happen while other threads use the device (a server's uploads run the model's
    offline path beside its stream loop): a capture takes the process-wide :data:`CAPTURE_LOCK`
    (one capture at a time) and runs in ``thread_local`` capture mode: in the default (global)
    mode another thread's ``cudaMalloc`` fails there and invalidates the capture. A capture
    that raises leaves every stream's state as it was (the warm-up and the capture touch
    scratch inputs only): the caller runs that step eagerly.

    ``simulate=True`` keeps everything but the CUDA graph itself (static buffers, warm-up on
    scratch inputs, copy-in, ``fn`` run on the static buffers at "replay"): the bucketing and
    padding of a family's step can be tested on the CPU.
    """

    def __init__(self, fn: Any, dummy: Any, max_graphs: int = 256, simulate: bool = False) -> None:
        self.fn = fn
        self.dummy = dummy
        self.max_graphs = max_graphs
        self.simulate = simulate
        self._graphs: dict[Any, tuple[Any, tuple, tuple]] = {}
        self._generation: Any = None
        self._pool: Any = None
        self.stats = {"captures": 0, "replays": 0}

    def capture(self, key: Any, generation: Any) -> None:
        """Capture the graph for ``key`` now (no-op when it exists)."""
        import torch

        if generation != self._generation:
            self._drop_all()
            self._generation = generation
        if key in self._graphs:
            return
        if len(self._graphs) >= self.max_graphs:
            self._drop_all()
        static_in = tuple(self.dummy(key))
        if self.simulate:
            self._graphs[key] = (None, static_in, tuple(self.fn(*static_in)))
            self.stats["captures"] += 1
            return
        with CAPTURE_LOCK:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn(*static_in)  # warm-up: lazy inits, library handles, FFT plans
            torch.cuda.current_stream().wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            caller_stream = torch.cuda.current_stream()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    static_out = self.fn(*static_in)
            except BaseException:
                # a capture that fails to begin or end leaves torch's capture stream current: the
                # caller's eager fallback must run on its own stream again
                torch.cuda.set_stream(caller_stream)
                # the failed graph may or may not hold the pool now: later captures start a new one
                self._pool = None
                self.stats["failures"] = self.stats.get("failures", 0) + 1
                raise
        self._graphs[key] = (graph, static_in, tuple(static_out))
        self.stats["captures"] += 1

    def try_capture(self, key: Any, generation: Any, owner: str) -> bool:
        """:meth:`capture`, or False when the capture failed: warned once (``owner``: the model's
        name), and the caller turns its graphs off and runs this step and the later ones
        eagerly. Nothing of any stream changed (see the class docstring)."""
        try:
            self.capture(key, generation)
        except Exception as exc:  # noqa: BLE001 - an op that cannot be captured: run eagerly
            warnings.warn(f"{owner}: streaming CUDA-graph capture failed ({exc!r}); the chunk step "
                          "runs eagerly from now on", RuntimeWarning, stacklevel=3)  # fmt: skip
            return False
        return True

    def _drop_all(self) -> None:
        """Forget every graph and their pool's handle (a new capture starts a fresh pool)."""
        self._graphs.clear()
        self._pool = None

    def run(self, key: Any, generation: Any, *inputs: torch.Tensor) -> tuple:
        self.capture(key, generation)
        graph, static_in, static_out = self._graphs[key]
        for dst, src in zip(static_in, inputs, strict=True):
            dst.copy_(src, non_blocking=True)
        if graph is None:  # simulated
            static_out = tuple(self.fn(*static_in))
        else:
            graph.replay()
        self.stats["replays"] += 1
        return static_out


class StepProfile:
    """Host seconds spent in each phase of a family's batched streaming steps (a benchmark's
    per-phase breakdown: ``python -m benchmarks.streambench --phases``).

    A family that supports it has an attribute ``stream_profile`` (None: no timing); set it to a
    ``StepProfile()`` and its ``stream_step`` adds to :attr:`seconds` by phase:

    ``features`` audio appended, chunk windows planned, the batch's audio (and its host->device
    copy) built; ``gather`` cache-pool index arithmetic (reserve, read / write rows) and its copy;
    ``encoder`` the encoder call launched (a CUDA-graph replay, or the eager forward on the CPU);
    ``wait`` the host waiting for the device's results (the one device->host copy of the step);
    ``search`` CTC / transducer search on the results; ``scatter`` per-stream bookkeeping after the
    call (pool advance, offsets, audio trimmed); ``results`` partial texts; ``finals`` the final
    transcripts of the streams that ended (search n-best, rescoring, transcript, caches freed).
    On CUDA the device work of features, gather, encoder and scatter all sits inside ``wait``."""

    PHASES = ("features", "gather", "encoder", "wait", "search", "scatter", "results", "finals")

    __slots__ = ("seconds", "steps", "rows", "calls", "finals", "_t")

    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        #: ``stream_step`` calls, stream rows they advanced, encoder calls they made, streams ended
        self.steps = 0
        self.rows = 0
        self.calls = 0
        self.finals = 0
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap (or :meth:`start`) to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] += now - self._t
        self._t = now

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, Any]:
        """Seconds per phase, and per step (ms) / per stream row (us) for a report."""
        steps, rows = max(self.steps, 1), max(self.rows, 1)
        return {"steps": self.steps, "rows": self.rows, "encoder_calls": self.calls, "finals": self.finals,
                "us_per_final": round(1e6 * self.seconds["finals"] / max(self.finals, 1), 3),
                "seconds": {k: round(v, 6) for k, v in self.seconds.items()},
                "ms_per_step": {k: round(1e3 * v / steps, 4) for k, v in self.seconds.items()},
                "us_per_row": {k: round(1e6 * v / rows, 3) for k, v in self.seconds.items()}}  # fmt: skip

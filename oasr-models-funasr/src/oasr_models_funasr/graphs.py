"""Paraformer's encoder + CIF predictor and its decoder replayed from CUDA graphs.

Without graphs the host needs longer to launch a batch's ~1500 kernels (50 encoder layers, 16
decoder layers, about 15-20 small kernels each) than the device needs to run them: the device
waits on Python. A graph launches all of a stage's kernels at once.

Shapes are bucketed so that a few graphs serve real traffic: the batch rounds up to core's
``oasr.stream_cache.BATCH_BUCKETS`` ladder (1, 2, 4, 8, 12, 16, 24, 32, 48, ...), the frames to a multiple of ``FRAME_STEP`` LFR frames
(about a second), the tokens to a multiple of ``TOKEN_STEP``. A call copies its inputs into the
bucket's static inputs (rows and frames past the input zero, padded rows one frame long),
replays, and returns copies of its rows and frames of the static outputs (one copy of an output
returned twice: the float32 encoder output of a float32 net). Padding never reaches
a row's values: attention masks padded keys, the FSMN memory zeroes padded frames before its
convolution (what it leaves in padded frames reaches only padded frames), everything else is
per frame, and the predictor zeroes the weights past each length (what lets the eager path batch rows of different lengths). Only the matrix
products see other shapes, which may pick other GEMM kernels: results agree with the eager path
to float rounding (tests/funasr/test_gpu.py compares both).

On by default on CUDA (``OASR_FUNASR_GRAPHS=0``, or ``model.cuda_graphs = False``: eager): on an
H200, a batch of 64 at paraformer-large's shape took 0.0357 s with graphs and 0.0463 s eagerly
(``python -m benchmarks.funasrbench``; tests/funasr/test_gpu.py checks graphs == eager there).
Nothing changes on the CPU.

A shape is captured the second time it is needed (one seen once, such as a run's last partial
batch, runs eagerly and is never captured), lazily, inside the model call that needs it: in the
thread that runs the model (the engine's worker), never ahead from another thread. A capture is
one eager warm-up pass on a side stream (kernels load, cuDNN plans) and the capture itself, in
``thread_local`` mode (the server's other threads may use the device meanwhile). A capture that
fails turns graphs off with a warning; that call and the later ones run eagerly on the same
inputs (a graph's inputs are copies: nothing of the call was consumed). All graphs share one
memory pool (replays never overlap: one lock); at most ``max_graphs`` are kept, the least
recently used is dropped (a fresh pool once none is left: torch refuses to capture into a pool
all of whose graphs are gone).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from oasr.defaults import env_switch
from oasr.stream_cache import BATCH_BUCKETS, CAPTURE_LOCK, bucket

__all__ = [
    "FRAME_STEP",
    "TOKEN_STEP",
    "ParaformerGraphs",
    "batch_bucket",
    "decode_tokens",
    "encode_predict",
    "graphs_enabled",
    "round_up",
]

#: encoder frames round up to a multiple of this (16 LFR frames: 0.96 s)
FRAME_STEP = 16
#: decoder tokens round up to a multiple of this
TOKEN_STEP = 8


def graphs_enabled() -> bool:
    """True unless ``OASR_FUNASR_GRAPHS`` is ``0`` (``false``, ``no``, ``off``); graphs run only
    on CUDA either way."""
    return env_switch("OASR_FUNASR_GRAPHS", True)


def round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def batch_bucket(n: int) -> int:
    """The batch's bucket: core's ``BATCH_BUCKETS`` ladder (``n`` itself past its end)."""
    return bucket(n, BATCH_BUCKETS)


def encode_predict(net: Any, feats: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(B, T, D) features in the net's dtype -> (encoder output (B, T, d) in the net's dtype,
    the same in float32 (the same tensor for a float32 net), predictor conv (B, d, T) float32,
    alphas (B, T) float32). The eager path and the captured graph both run this."""
    enc_h = net.encoder(feats, lens)
    enc = enc_h.float()
    conv, alphas = net.predictor(enc, lens)
    return enc_h, enc, conv, alphas.float()


def decode_tokens(
    net: Any,
    memory: torch.Tensor,
    mem_lens: torch.Tensor,
    embeds: torch.Tensor,
    ntok: torch.Tensor,
    bias: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's argmax per token: (best log-probability (B, N) float32, token ids (B, N)).
    ``bias(logp, hidden) -> logp`` (SeACo hotwords, eager only) rewrites the log-probabilities
    from the decoder's hidden states first. The eager path and the captured graph both run this."""
    logits, hidden = net.decoder(memory, mem_lens, embeds, ntok)
    logp = torch.log_softmax(logits.float(), dim=-1)
    if bias is not None:
        logp = bias(logp, hidden)
    best, ids = logp.max(dim=-1)
    return best, ids


class _Graph:
    """One captured graph: its static inputs and outputs."""

    def __init__(self, inputs: tuple[torch.Tensor, ...]) -> None:
        self.inputs = inputs
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.graph: Any = None  # a torch.cuda.CUDAGraph


class ParaformerGraphs:
    """``encode_predict`` and ``decode`` of a CUDA :class:`~oasr_models_funasr.nn.ParaformerNet`
    from CUDA graphs; both return exactly what their eager versions in
    :mod:`oasr_models_funasr.model` return (up to the GEMMs' float rounding)."""

    def __init__(self, net: Any, capture_after: int = 2, max_graphs: int = 32) -> None:
        self.net = net
        self.capture_after = max(1, int(capture_after))
        self.max_graphs = max(1, int(max_graphs))
        self._uses: dict[tuple, int] = {}
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._pool: Any = None
        self._lock = threading.Lock()
        self.stats = {"captures": 0, "replays": 0, "eager": 0}
        #: why graphs were turned off (a capture failed), else None
        self.disabled: str | None = None

    # ------------------------------------------------------------------ the captured functions
    def _encode_predict(self, feats: torch.Tensor, lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:func:`encode_predict` of this net."""
        return encode_predict(self.net, feats, lens)

    def _decode(
        self, memory: torch.Tensor, mem_lens: torch.Tensor, embeds: torch.Tensor, ntok: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """:func:`decode_tokens` of this net (no bias)."""
        return decode_tokens(self.net, memory, mem_lens, embeds, ntok)

    # ------------------------------------------------------------------ public calls
    def encode_predict(
        self, feats: torch.Tensor, lens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = feats.shape
        feats = feats.to(self.net.dtype)
        key = ("enc", batch_bucket(b), round_up(t, FRAME_STEP), d, feats.dtype)
        shapes = ((key[1], key[2], d), (key[1],))

        def take(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            enc_h, enc, conv, alphas = out
            return enc_h[:b, :t], enc[:b, :t], conv[:b, :, :t], alphas[:b, :t]

        out = self._run(key, self._encode_predict, (feats, lens), shapes, b, take)
        if out is None:
            return self._encode_predict(feats, lens)  # type: ignore[return-value]
        return out  # type: ignore[return-value]

    def decode(
        self, memory: torch.Tensor, mem_lens: torch.Tensor, embeds: torch.Tensor, ntok: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = memory.shape
        n = embeds.shape[1]
        bb = batch_bucket(b)
        key = ("dec", bb, round_up(t, FRAME_STEP), round_up(n, TOKEN_STEP), d, memory.dtype)
        shapes = ((bb, key[2], d), (bb,), (bb, key[3], embeds.shape[2]), (bb,))

        def take(out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
            return tuple(x[:b, :n] for x in out)

        args = (memory, mem_lens, embeds, ntok)
        out = self._run(key, self._decode, args, shapes, b, take)
        if out is None:
            return self._decode(*args)  # type: ignore[return-value]
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ machinery
    def _run(
        self,
        key: tuple,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        args: tuple[torch.Tensor, ...],
        shapes: tuple[tuple[int, ...], ...],
        rows: int,
        take: Callable[[tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
    ) -> tuple[torch.Tensor, ...] | None:
        """Replay ``key``'s graph on ``args`` (capturing it on its second use) and return
        copies of ``take`` of its static outputs (the call's rows and frames), made before any
        other replay can overwrite them; None: run eagerly instead (first use, graphs off)."""
        capturing = args[0].is_cuda and torch.cuda.is_current_stream_capturing()
        if self.disabled is not None or capturing:
            self.stats["eager"] += 1
            return None
        with self._lock:
            g = self._graphs.get(key)
            if g is None:
                uses = self._uses[key] = self._uses.get(key, 0) + 1
                if uses < self.capture_after:
                    self.stats["eager"] += 1
                    return None
                try:
                    g = self._capture(key, fn, args, shapes)
                except Exception as exc:  # noqa: BLE001 - any capture failure: stay eager
                    # an op that reads back to the host (a quantized layer's scale, a kernel
                    # provider's override) cannot be captured; the eager path still works
                    self.disabled = f"{type(exc).__name__}: {exc}"
                    warnings.warn(f"Paraformer CUDA graphs off, the capture failed: {self.disabled}",
                                  RuntimeWarning, stacklevel=3)  # fmt: skip
                    if args[0].is_cuda:
                        torch.cuda.synchronize()
                    self.stats["eager"] += 1
                    return None
            else:
                self._graphs.move_to_end(key)
            self._fill(g.inputs, args, rows)
            assert g.graph is not None
            g.graph.replay()
            self.stats["replays"] += 1
            # one copy of a view taken twice (a float32 net's encoder output is its .float())
            copies: dict[tuple, torch.Tensor] = {}
            out = []
            for x in take(g.outputs):
                k = (x.data_ptr(), x.shape, x.stride(), x.dtype)
                if k not in copies:
                    copies[k] = x.clone()
                out.append(copies[k])
            return tuple(out)

    @staticmethod
    def _fill(static: tuple[torch.Tensor, ...], args: tuple[torch.Tensor, ...], rows: int) -> None:
        """Copy the call's inputs into the static ones: float inputs zero-padded, length inputs
        1 on padded rows (a one-frame / one-token row: finite values, then dropped)."""
        for s, a in zip(static, args, strict=True):
            if s.dim() == 1:
                s.fill_(1)
                s[:rows].copy_(a)
            else:
                s.zero_()
                s[:rows, : a.shape[1]].copy_(a)

    def _capture(
        self,
        key: tuple,
        fn: Callable[..., tuple[torch.Tensor, ...]],
        args: tuple[torch.Tensor, ...],
        shapes: tuple[tuple[int, ...], ...],
    ) -> _Graph:
        dev = args[0].device
        static = tuple(
            torch.ones(s, dtype=a.dtype, device=dev)
            if len(s) == 1
            else torch.zeros(s, dtype=a.dtype, device=dev)
            for s, a in zip(shapes, args, strict=True)
        )
        g = _Graph(static)
        while len(self._graphs) >= self.max_graphs:
            self._graphs.popitem(last=False)
        if not self._graphs:
            # every graph of the pool is gone: torch asserts on a capture into such a pool
            # (CUDACachingAllocator's use_count > 0), so this one starts a new pool
            self._pool = None
        g.graph, g.outputs = self._record(fn, static)
        self._graphs[key] = g
        self.stats["captures"] += 1
        return g

    def _record(
        self, fn: Callable[..., tuple[torch.Tensor, ...]], static: tuple[torch.Tensor, ...]
    ) -> tuple[Any, tuple[torch.Tensor, ...]]:
        """(the CUDA graph of ``fn(*static)``, its output tensors)."""
        dev = static[0].device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            fn(*static)  # warm-up outside the capture: kernels load, cuDNN plans, caches fill
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(dev)
        try:
            # thread_local: the engine's other threads (audio, features of the next batch) may
            # use the device meanwhile; only this thread's calls are checked against the capture
            # (and one capture at a time in the process: oasr.stream_cache.CAPTURE_LOCK)
            with CAPTURE_LOCK, torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                outputs = fn(*static)
        finally:
            # a capture that fails to begin or end leaves its own stream current: the eager
            # fallback and later calls run on the caller's stream again
            torch.cuda.set_stream(stream)
        return graph, outputs

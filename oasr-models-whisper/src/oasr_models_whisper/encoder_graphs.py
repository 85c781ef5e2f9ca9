"""Whisper's encoder replayed from CUDA graphs, one per (batch bucket, dtype).

Every Whisper window is 3000 mel frames, so the encoder's shapes depend only on the batch. A
batch of ``n`` windows runs in the graph of the smallest bucket ``>= n``: the mels are copied
into the bucket's static input (rows past ``n`` keep zeros; rows never mix in the encoder), the
graph is replayed, and the first ``n`` rows of its static output are returned as a copy (the
next replay overwrites the static output). A bucket is captured the ``capture_after``-th time it
is needed (default the second: a batch size seen once, such as the last partial batch of a run,
never pays for a capture), the calls before run eagerly; the capture is one eager warm-up pass
on a side stream (kernels compile, cuDNN plans), then the capture itself. All buckets share one
memory pool: replays never overlap, and each graph's output stays allocated.

A batch larger than the largest bucket or a CPU network runs the encoder eagerly. Outputs
equal the eager encoder's run on the padded batch (same kernels, same order). The executor uses
this only with ``OASR_ENCODER_GRAPHS=1``: measured on the H200, the large-v3 encoder is
GPU-bound (0.99x eager at batch 8), so by default it runs eagerly.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch

__all__ = ["BUCKETS", "EncoderGraphs", "encoder_graphs_enabled"]

#: batch buckets (the executor's encoder batches are at most max_batch_size windows)
BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def encoder_graphs_enabled() -> bool:
    """``OASR_ENCODER_GRAPHS=1`` (off by default)."""
    return os.environ.get("OASR_ENCODER_GRAPHS", "0") in ("1", "true", "yes")


class _Captured:
    def __init__(self, mel: torch.Tensor) -> None:
        self.mel = mel
        self.out: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None


class EncoderGraphs:
    """``graphs(mel)`` == ``net.encode(mel)`` for (B, n_mels, 3000) mels, from CUDA graphs."""

    def __init__(self, net: Any, buckets: tuple[int, ...] = BUCKETS, capture_after: int = 2) -> None:
        self.net = net
        self.buckets = tuple(sorted(buckets))
        self.capture_after = max(1, int(capture_after))
        self._uses: dict[tuple[int, torch.dtype], int] = {}
        self._graphs: dict[tuple[int, torch.dtype], _Captured] = {}
        self._pool: Any = None
        self._lock = threading.Lock()
        self.stats = {"captures": 0, "replays": 0, "eager": 0}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def _capture(self, b: int, dtype: torch.dtype, like: torch.Tensor) -> _Captured:
        net = self.net
        g = _Captured(torch.zeros((b, *like.shape[1:]), dtype=dtype, device=net.device))
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device=net.device)
        side.wait_stream(torch.cuda.current_stream(net.device))
        with torch.cuda.stream(side):
            net.encode(g.mel)  # warm-up: compiles kernels and plans cuDNN outside capture
        torch.cuda.current_stream(net.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            g.out = net.encode(g.mel)
        g.graph = graph
        self.stats["captures"] += 1
        return g

    def __call__(self, mel: torch.Tensor) -> torch.Tensor:
        net = self.net
        if mel.dim() == 2:
            mel = mel.unsqueeze(0)
        n = mel.shape[0]
        b = self.bucket(n)
        if net.device.type != "cuda" or b is None or n == 0 or torch.cuda.is_current_stream_capturing():
            self.stats["eager"] += 1
            return net.encode(mel)
        if mel.shape[1] != net.dims.n_mels:
            return net.encode(mel)  # the network raises its own error
        key = (b, mel.dtype)
        with self._lock:
            g = self._graphs.get(key)
            if g is None:
                uses = self._uses[key] = self._uses.get(key, 0) + 1
                if uses < self.capture_after:
                    self.stats["eager"] += 1
                    return net.encode(mel)
                g = self._graphs[key] = self._capture(b, mel.dtype, mel)
            if g.mel.shape[1:] != mel.shape[1:]:
                self.stats["eager"] += 1
                return net.encode(mel)
            g.mel[:n].copy_(mel.to(net.device))
            if n < b:
                g.mel[n:].zero_()
            assert g.graph is not None and g.out is not None
            g.graph.replay()
            self.stats["replays"] += 1
            return g.out[:n].clone()

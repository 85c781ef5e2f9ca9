"""Batches of waveforms for the feature frontends and the families' model calls.

``padded_batch`` is how a family moves a batch of waveforms to its device (one reused
page-locked buffer and one asynchronous copy on CUDA); ``as_batch`` normalises what a frontend
is given; ``mask_frames`` blanks the frames past each item's length."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from oasr.errors import InvalidRequestError

__all__ = ["as_batch", "mask_frames", "padded_batch"]


def as_batch(
    audio: torch.Tensor | np.ndarray | list, lengths: torch.Tensor | list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Waveform(s) -> ((B, T) float32 tensor, (B,) int64 lengths on the same device, was_1d).

    Accepts a (T,) or (B, T) tensor/array, or a list of 1-D waveforms (zero-padded here).
    """
    if isinstance(audio, (list, tuple)):
        items = [torch.as_tensor(a).reshape(-1) for a in audio]
        if not items:
            raise InvalidRequestError("empty batch of waveforms", param="audio")
        device = items[0].device
        n = max(int(a.shape[0]) for a in items)
        x = torch.zeros(len(items), n, dtype=torch.float32, device=device)
        for i, a in enumerate(items):
            x[i, : a.shape[0]] = a.to(device=device, dtype=torch.float32)
        lens = torch.tensor([a.shape[0] for a in items], dtype=torch.long, device=device)
        if lengths is not None:
            lens = torch.as_tensor(lengths, dtype=torch.long, device=device)
        return x, lens, False
    x = torch.as_tensor(audio)
    if x.dtype != torch.float32:
        x = x.float()
    was_1d = x.dim() == 1
    if was_1d:
        x = x.unsqueeze(0)
    if x.dim() != 2:
        raise InvalidRequestError(
            f"waveforms must be (T,) or (B, T), got shape {tuple(x.shape)}; down-mix first",
            param="audio",
        )
    if lengths is None:
        lens = torch.full((x.shape[0],), x.shape[1], dtype=torch.long, device=x.device)
    else:
        lens = torch.as_tensor(lengths, dtype=torch.long, device=x.device).reshape(-1)
        if lens.shape[0] != x.shape[0]:
            raise InvalidRequestError(
                f"{lens.shape[0]} lengths for {x.shape[0]} waveforms", param="lengths"
            )
    return x, lens, was_1d


class _PinnedStaging(threading.local):
    """One page-locked host buffer per thread (the model thread reuses it call after call) and
    the event of the copy that last read it, so it is not overwritten while in flight."""

    buffer: torch.Tensor | None = None
    event: torch.cuda.Event | None = None


_staging = _PinnedStaging()

#: batches of at least this many samples (64 MB) fill the staging buffer in parallel
_PARALLEL_FILL_SAMPLES = 16 << 20
_pool = None
_pool_lock = threading.Lock()


def _fill_workers() -> int:
    return min(8, (os.cpu_count() or 1) // 2)


def _fill_pool():
    global _pool
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(_fill_workers(), thread_name_prefix="oasr-batch-fill")
        return _pool


def padded_batch(
    waves: Sequence[np.ndarray], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Waveforms -> ((B, T) float32 zero-padded batch, (B,) int64 lengths), both on ``device``.

    On CUDA the batch goes through a reused page-locked buffer in one asynchronous copy: a
    pageable copy of a batch of 30 s inputs stages tens of megabytes through the driver and
    zero-filling a fresh padded tensor costs as much again, which the host pays before every
    model call (what each family used to do)."""
    if not waves:
        raise InvalidRequestError("empty batch of waveforms", param="audio")
    dev = torch.device(device)
    lens = [int(len(w)) for w in waves]
    b, n = len(waves), max(lens)
    if dev.type != "cuda":
        host = np.zeros((b, n), dtype=np.float32)
        for i, w in enumerate(waves):
            host[i, : lens[i]] = w
        return torch.from_numpy(host).to(dev), torch.tensor(lens, dtype=torch.long, device=dev)
    need = b * n
    st = _staging
    if st.event is not None:
        st.event.synchronize()  # the previous batch's copy has left the buffer
    if st.buffer is None or st.buffer.numel() < need:
        st.buffer = torch.empty(max(need, 1 << 20), dtype=torch.float32, pin_memory=True)
    flat = st.buffer[: b * n]
    rows = flat.numpy().reshape(b, n)

    def fill(i: int) -> None:
        rows[i, : lens[i]] = waves[i]
        rows[i, lens[i] :] = 0.0

    if need >= _PARALLEL_FILL_SAMPLES and _fill_workers() > 1:
        # a large batch (128 x 30 s is 245 MB) is filled by several threads: numpy releases
        # the GIL while it copies, and one core alone cannot use the host's memory bandwidth
        list(_fill_pool().map(fill, range(b)))
    else:
        for i in range(b):
            fill(i)
    x = flat.view(b, n).to(dev, non_blocking=True)
    st.event = torch.cuda.Event()
    st.event.record()
    # pin_memory() comes from torch's caching host allocator, which keeps the block until the
    # copy is done
    lengths = torch.tensor(lens, dtype=torch.long).pin_memory().to(dev, non_blocking=True)
    return x, lengths


def mask_frames(feats: torch.Tensor, frame_lengths: torch.Tensor, value: float = 0.0) -> torch.Tensor:
    """Set frames at or beyond each item's length to ``value``; feats is (B, F, D)."""
    f = feats.shape[1]
    mask = torch.arange(f, device=feats.device)[None, :] >= frame_lengths[:, None]
    return feats.masked_fill(mask[:, :, None], value)

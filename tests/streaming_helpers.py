"""Helpers shared by streaming tests (importable as ``tests.streaming_helpers``)."""

from __future__ import annotations

from typing import Any

import numpy as np


def feed_streams(model: Any, states: list[Any], audios: list[np.ndarray], piece: int,
                 starts: list[int] | None = None) -> list[Any]:
    """All streams through ``model.stream_step`` in shared batches of ``piece`` samples each,
    stream i joining at step ``starts[i]`` (default: all at once), until every stream has its
    final update. Returns the final updates, in the streams' order."""
    starts = starts or [0] * len(audios)
    pos, finals, step = [0] * len(audios), [None] * len(audios), 0
    while any(f is None for f in finals):
        rows = [i for i in range(len(audios)) if finals[i] is None and starts[i] <= step]
        step += 1
        if not rows:
            continue
        chunks = [audios[i][pos[i] : pos[i] + piece] for i in rows]
        for i in rows:
            pos[i] += piece
        ups = model.stream_step([states[i] for i in rows], chunks,
                                [pos[i] >= len(audios[i]) for i in rows])  # fmt: skip
        for i, up in zip(rows, ups, strict=True):
            if up.is_final:
                finals[i] = up
    return finals

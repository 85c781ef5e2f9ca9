"""``apply_timestamp_rules`` on the CPU (row slices) gives exactly its batched (B, V)-mask form,
the GPU's, for every combination of the state the rules read."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import torch

from oasr_models_whisper.decoding import (
    NO_MAX_INITIAL,
    _force_likelier_timestamp,
    _timestamp_masks_batched,
    apply_timestamp_rules,
)

V, EOT, NO_TS, TB = 640, 500, 519, 520


def test_cpu_rules_equal_the_batched_rules():
    tok = SimpleNamespace(timestamp_begin=TB, eot=EOT, no_timestamps=NO_TS)
    cols = torch.arange(V)
    states = list(itertools.product((0, 1, 2, 7), (0, 1), (0, 1), (-1, TB, TB + 40), (3, 50, NO_MAX_INITIAL)))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(states) + 3, V, generator=g) * 3
    logits[::3, TB:] += 6  # timestamps outweigh the text on some rows: the last rule fires
    # rows in a scrambled order, and three rows without timestamps that neither path touches
    order = torch.randperm(len(states), generator=g).tolist()
    host = np.array([(*states[k], i) for k, i in zip(order, range(len(states)), strict=True)], dtype=np.int64)
    n, last, penult, last_ts, max_initial, idx = torch.from_numpy(host).unbind(1)
    want = logits.clone()
    sub = want[idx]
    _timestamp_masks_batched(sub, tok, cols, n, last.bool(), penult.bool(), last_ts, max_initial)
    _force_likelier_timestamp(sub, TB, cols)
    want[idx] = sub
    got = logits.clone()
    sub = got[idx]
    apply_timestamp_rules(sub, tok, sampled_count=n, last_is_ts=last.bool(), penult_is_ts=penult.bool(),
                          last_ts=last_ts, max_initial=max_initial, cols=cols)  # fmt: skip
    got[idx] = sub
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)  # the rules did mask something
    forced = torch.isinf(got[:, :TB]).all(dim=1) & ~torch.isinf(logits[:, :TB]).all(dim=1)
    assert bool(forced.any())  # ... and the last rule forced a timestamp on some row

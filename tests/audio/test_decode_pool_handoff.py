"""``oasr.decode_pool``'s shared-memory handoff: large results come back through a file in
``/dev/shm`` with exactly the samples of the result pipe, small ones and failed writes through
the pipe, and no file is left behind."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from oasr import decode_pool
from oasr.audio import load_audio
from oasr.decode_pool import SHARED_MIN_BYTES, AudioDecodePool, _hand_off, _Handoff, _take

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
#: a 44.1 kHz stereo FLAC (resampled, mixed down: 0.7 MB of samples) and a 2 s WAV (0.13 MB)
FILES = [SPEECH / "en_jfk_inaugural.flac", SPEECH / "en_ls_2830-3980-0043.wav"]


def _handoff_files(directory: str, pids: set[int]) -> set[str]:
    """The handoff files of the worker processes ``pids`` (``oasr-decode-<pid>-<token>``): other
    OASR processes on the machine may be handing off at the same time."""
    return {n for n in os.listdir(directory) if n.startswith("oasr-decode-") and int(n.split("-")[2]) in pids}


def test_hand_off_round_trip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    big = rng.standard_normal(SHARED_MIN_BYTES // 4 + 17).astype(np.float32)
    small = big[:100].copy()
    moved = _hand_off(big, str(tmp_path))
    assert isinstance(moved, _Handoff) and os.path.exists(moved.path)
    back = _take(moved)
    assert back.dtype == np.float32 and np.array_equal(back, big)
    assert not os.path.exists(moved.path)
    assert _hand_off(small, str(tmp_path)) is small  # under the threshold: the pipe
    assert _hand_off(big, None) is big  # no shared directory
    assert _hand_off(big, str(tmp_path / "missing")) is big  # cannot write: the pipe
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(decode_pool._shared_dir() is None, reason="no writable /dev/shm")
def test_pool_results_equal_through_either_path() -> None:
    want = [load_audio(p, 16000) for p in FILES]
    assert all(w.nbytes >= SHARED_MIN_BYTES for w in want)
    for shared in (True, False):
        pool = AudioDecodePool(2, shared_memory=shared)
        try:
            assert (pool.shared_dir is not None) is shared
            futures = [pool.submit(p, 16000) for p in FILES * 3]
            for fut, w in zip(futures, want * 3, strict=True):
                got = fut.result(timeout=60)
                assert got.dtype == np.float32 and np.array_equal(got, w)
            workers = set(pool._current()._processes)
        finally:
            pool.shutdown()
        assert workers and _handoff_files(decode_pool.SHARED_DIR, workers) == set()

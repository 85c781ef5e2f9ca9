"""Decoders for the decode-pool tests. They run inside worker processes, so they live in a
plain module the workers can import (the tests put this folder on ``sys.path``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def crash_once_then_decode(data: bytes, sample_rate: int, *, marker: str, **kwargs: Any) -> Any:
    """Kill the worker the first time (``marker`` file absent), decode normally afterwards."""
    from oasr.audio import load_audio

    flag = Path(marker)
    if not flag.exists():
        flag.write_text("crashed once")
        os._exit(3)  # what a segfaulting decoder looks like to the pool
    return load_audio(data, sample_rate, **kwargs)


def always_crash(data: bytes, sample_rate: int, **kwargs: Any) -> Any:
    os._exit(4)

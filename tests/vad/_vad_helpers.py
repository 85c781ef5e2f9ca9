"""Helpers shared by the VAD tests (imported by name; conftest puts this folder on sys.path)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import torch

SPEECH = Path(__file__).resolve().parents[1] / "data" / "speech"
FILES_16K = ["en_ls_1089-134686-0001.wav", "en_ls_1221-135766-0002.wav"]
FILE_8K = "en_osr_us_000_0034_8k.wav"
TOL = 1e-4


def read(name: str) -> tuple[np.ndarray, int]:
    x, sr = sf.read(str(SPEECH / name), dtype="float32", always_2d=False)
    if x.ndim > 1:
        x = x.mean(axis=1)
    return np.ascontiguousarray(x, dtype=np.float32), int(sr)


def jit_probs(model, x: np.ndarray, sr: int) -> np.ndarray:
    """The package's model fed window by window from a fresh state, last window zero-padded:
    exactly what silero_vad.get_speech_timestamps computes."""
    w = 512 if sr == 16000 else 256
    model.reset_states()
    out = []
    with torch.no_grad():
        for s in range(0, len(x), w):
            chunk = torch.from_numpy(x[s : s + w])
            if len(chunk) < w:
                chunk = torch.nn.functional.pad(chunk, (0, w - len(chunk)))
            out.append(model(chunk, sr).item())
    return np.asarray(out, dtype=np.float64)

"""Shared fixtures for the VAD tests: the OASR detector, the silero-vad package's own TorchScript
model as the reference, and real speech from tests/data/speech.

Torch runs single-threaded here: the reference JIT model is ~20x slower with two threads on a
busy 2-core machine. The previous setting is restored after each module.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("oasr_vad_silero")
sf = pytest.importorskip("soundfile")
if importlib.util.find_spec("silero_vad") is None:  # the reference model and default weights
    pytest.skip("silero-vad is not installed", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).parent))

from _vad_helpers import jit_probs, read  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def vad():
    from oasr_vad_silero import SileroVAD

    return SileroVAD()


@pytest.fixture(scope="session")
def jit_model():
    from oasr_vad_silero.weights import package_data_file

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        model = torch.jit.load(str(package_data_file()), map_location="cpu")
    model.eval()
    return model


_REF_CACHE: dict[tuple[str, int], np.ndarray] = {}


@pytest.fixture(scope="session")
def ref_probs(jit_model):
    def get(name: str) -> tuple[np.ndarray, int, np.ndarray]:
        x, sr = read(name)
        key = (name, sr)
        if key not in _REF_CACHE:
            _REF_CACHE[key] = jit_probs(jit_model, x, sr)
        return x, sr, _REF_CACHE[key]

    return get


@pytest.fixture(scope="session")
def silero_utils():
    """silero_vad.utils_vad (importing the package sets torch threads to 1: restore after)."""
    old = torch.get_num_threads()
    from silero_vad import utils_vad

    torch.set_num_threads(old)
    return utils_vad

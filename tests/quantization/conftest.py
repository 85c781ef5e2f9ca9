"""Quantization fixtures (one torch thread); shared helpers are in ``qhelpers.py``."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    """Tiny networks: one thread is fastest and steady on a busy 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)

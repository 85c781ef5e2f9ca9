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


@pytest.fixture(autouse=True, scope="package")
def _private_quant_cache(tmp_path_factory):
    """The quantized-weight disk cache in a temporary directory, not the user's cache."""
    import os

    from oasr.quantization.cache import DIR_ENV

    old = os.environ.get(DIR_ENV)
    os.environ[DIR_ENV] = str(tmp_path_factory.mktemp("quant_cache"))
    yield
    if old is None:
        os.environ.pop(DIR_ENV, None)
    else:
        os.environ[DIR_ENV] = old

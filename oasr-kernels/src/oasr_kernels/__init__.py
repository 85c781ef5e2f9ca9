"""OASR plugin: CUDA kernels for ``oasr.layers`` ops, compiled with NVRTC (CuPy) on first use.

Light on import: nothing here imports torch or CuPy. The ``cuda`` kernel provider
(:func:`oasr_kernels.provider.install`) is installed by OASR when a model is loaded on a CUDA
device; it overrides ``paged_decode_attention`` (see ``docs/layers.md``).
"""

from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["__version__"]

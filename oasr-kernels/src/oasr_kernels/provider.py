"""The ``cuda`` kernel provider: registers this package's ``oasr.layers`` overrides.

Called by :func:`oasr.kernel_providers.install_kernel_providers` when a model is loaded on a CUDA
device. Raises (and so leaves the native ops in place, with a warning) when CuPy is missing.
"""

from __future__ import annotations

__all__ = ["OPS", "install"]

#: the oasr.layers ops this provider overrides on "cuda"
OPS = ("paged_decode_attention",)


def install(device_type: str = "cuda") -> list[str]:
    """Register the CUDA overrides. Returns the op names overridden."""
    if device_type != "cuda":
        raise ValueError(f"oasr-kernels provides CUDA kernels, not {device_type!r} ones")
    try:
        import cupy  # noqa: F401 - NVRTC compilation and launches go through CuPy
    except ImportError as exc:
        raise ImportError(
            "oasr-kernels needs CuPy: pip install 'oasr-kernels[cuda12]' (CUDA 12) or "
            "'oasr-kernels[cuda13]' (CUDA 13)"
        ) from exc
    from oasr.layers import register_override
    from oasr_kernels.paged_attention import paged_decode_attention_cuda

    register_override("paged_decode_attention", "cuda", paged_decode_attention_cuda)
    return list(OPS)

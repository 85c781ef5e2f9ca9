"""The ``cuda`` kernel provider: registers this package's ``oasr.layers`` overrides.

Called by :func:`oasr.kernel_providers.install_kernel_providers` when a model is loaded on a CUDA
device. Raises (and so leaves the native ops in place, with a warning) when CuPy is missing.
Also registers the kernels' search spaces with :mod:`oasr.tune` (for ``oasr.tune.autotune``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["OPS", "install", "register_shipped_entries"]

#: the oasr.layers ops this provider overrides on "cuda"
OPS = (
    "paged_decode_attention",
    "paged_prefill_attention",
    "add_norm",
    "rms_norm",
    "rotary_qk",
    "silu_mul",
    "bias_act",
    "glu_depthwise_conv1d",
    "log_mel_power",
    "paged_decode_attention_fp8",
    "cross_attention_fp8",
    "quantize_activations",
    "quantize_kv_into",
    "dequantize_kv",
    "ctc_prefix_beam_frames",
)


def _register(op: str, fn: Callable[..., Any]) -> None:
    from oasr.layers import register_override

    register_override(op, "cuda", fn)


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
    from oasr.tune import register_tunable
    from oasr_kernels import fused, llm_ops, prefill_attention
    from oasr_kernels.paged_attention import paged_decode_attention_cuda

    _register("paged_decode_attention", paged_decode_attention_cuda)
    _register("paged_prefill_attention", prefill_attention.paged_prefill_attention_cuda)
    _register("add_norm", fused.add_norm_cuda)
    _register("rms_norm", fused.rms_norm_cuda)
    _register("rotary_qk", llm_ops.rotary_qk_cuda)
    _register("silu_mul", llm_ops.silu_mul_cuda)
    _register("bias_act", fused.bias_act_cuda)
    _register("glu_depthwise_conv1d", fused.glu_depthwise_conv1d_cuda)
    _register("log_mel_power", fused.log_mel_power_cuda)
    import oasr.layers.quantized  # noqa: F401 - declares the fp8 KV cache's and quantization's ops
    from oasr_kernels.paged_attention_fp8 import paged_decode_attention_fp8_cuda

    _register("paged_decode_attention_fp8", paged_decode_attention_fp8_cuda)
    from oasr_kernels.cross_attention_fp8 import cross_attention_fp8_cuda

    _register("cross_attention_fp8", cross_attention_fp8_cuda)
    from oasr_kernels.quantize_act import (
        dequantize_kv_cuda,
        quantize_activations_cuda,
        quantize_kv_into_cuda,
    )

    _register("quantize_activations", quantize_activations_cuda)
    _register("quantize_kv_into", quantize_kv_into_cuda)
    _register("dequantize_kv", dequantize_kv_cuda)
    from oasr.decoders.ctc_gpu import FRAMES_OP
    from oasr.layers._dispatch import declare_op
    from oasr_kernels.ctc_beam import ctc_prefix_beam_frames_cuda

    declare_op(FRAMES_OP)  # the CTC prefix beam search's frame loop (oasr.decoders.ctc_gpu)
    _register(FRAMES_OP, ctc_prefix_beam_frames_cuda)
    for tunable in fused.TUNABLES + prefill_attention.TUNABLES:
        register_tunable(tunable)
    register_shipped_entries()
    return list(OPS)


def register_shipped_entries() -> list[str]:
    """Autotune entries measured on reference GPUs (``tuned/<arch>.json``, written by
    ``python -m oasr.tune --out``): launch parameters and ``use_kernel`` decisions for GPUs of
    that architecture that have no cache file of their own. Returns the architectures."""
    import json
    from importlib import resources

    from oasr.tune import register_builtin

    archs = []
    root = resources.files("oasr_kernels").joinpath("tuned")
    if not root.is_dir():
        return archs
    for item in sorted(root.iterdir(), key=lambda p: p.name):
        if not item.name.endswith(".json"):
            continue
        data = json.loads(item.read_text())
        register_builtin(data["arch"], data.get("entries", {}))
        archs.append(data["arch"])
    return archs

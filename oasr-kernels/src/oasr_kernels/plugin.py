"""Hook module named by the ``oasr`` entry point. Must stay light: no torch or CuPy import here."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register


@hookimpl
def register_kernel_providers(register: Register) -> None:
    register(
        "cuda",
        "oasr_kernels.provider:install",
        device_types=["cuda"],
        ops=["paged_decode_attention", "paged_prefill_attention", "add_norm", "rms_norm", "bias_act",
             "glu_depthwise_conv1d", "log_mel_power"],
        description="CUDA kernels compiled with NVRTC (CuPy) on first use",
    )

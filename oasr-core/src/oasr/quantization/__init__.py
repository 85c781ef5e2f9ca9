"""Quantization at the ``oasr.layers`` waist: W8A8 int8 / fp8 linears for every family, SmoothQuant
calibration (``oasr quantize``), the quantized native checkpoint (format version 2) and the fp8
KV cache.

This module is torch-free (``EngineConfig`` validates names with it); the work lives in

* :mod:`oasr.quantization.numerics`: the quantized math (per-output-channel weight scales,
  per-token dynamic activation scales) and its float64 reference;
* :mod:`oasr.layers.quantized`: :class:`~oasr.layers.quantized.QuantizedLinear`, the module that
  replaces :class:`oasr.layers.Linear` (int8 GEMM through ``torch._int_mm``, fp8 through
  ``torch._scaled_mm``);
* :mod:`oasr.quantization.apply`: which linears of a model are replaced (each family's
  keep-in-high-precision list) and the device checks;
* :mod:`oasr.quantization.smoothquant` and :mod:`oasr.quantization.checkpoint`: calibration and
  the version-2 native checkpoint.

See ``docs/quantization.md``.
"""

from __future__ import annotations

from typing import Any

from oasr.errors import UnsupportedOptionError

__all__ = [
    "KV_CACHE_DTYPES",
    "METHODS",
    "RECIPES",
    "check_kv_cache_dtype",
    "check_method",
    "compute_type_method",
    "quantize_model",
]

#: online methods: name -> (weight/activation format, what it needs)
METHODS: dict[str, str] = {
    "int8_w8a8": "int8 weights (per output channel) and int8 activations (per token, dynamic); "
    "CPU and CUDA",
    "fp8_w8a8": "float8 e4m3 weights (per output channel) and activations (per token, dynamic); "
    "CUDA GPUs of compute capability 8.9 or later (Ada, Hopper, Blackwell)",
}

#: calibrated recipes of ``oasr quantize``: name -> what it does
RECIPES: dict[str, str] = {
    "smoothquant_w8a8": "SmoothQuant: per-input-channel activation maxima from real audio, "
    "difficulty migrated from activations to weights with --alpha, then int8_w8a8",
    "smoothquant_fp8": "the same smoothing, then fp8_w8a8 (a CUDA GPU with fp8 loads it)",
    "w8a8": "int8_w8a8 without smoothing (the online method, written to disk)",
    "fp8": "fp8_w8a8 without smoothing",
}

#: ``kv_cache_dtype`` values: None/"auto" keeps the model's dtype
KV_CACHE_DTYPES = ("auto", "fp8")

_ALIASES = {"int8": "int8_w8a8", "w8a8": "int8_w8a8", "fp8": "fp8_w8a8", "float8": "fp8_w8a8"}


def check_method(name: str | None) -> str | None:
    """The canonical method name for ``name`` (``int8_w8a8``, ``fp8_w8a8``; ``int8`` and ``fp8``
    are accepted as short forms), None for None / ``"none"``; anything else is a typed error."""
    if name is None:
        return None
    key = str(name).strip().lower()
    if key in ("", "none", "off"):
        return None
    key = _ALIASES.get(key, key)
    if key not in METHODS:
        raise UnsupportedOptionError(
            f"quantization {name!r} is not supported; use one of: {', '.join(METHODS)}",
            param="quantization",
        )
    return key


def check_kv_cache_dtype(name: str | None) -> str | None:
    """None for the model's own dtype (None / ``"auto"``), ``"fp8"`` for float8 e4m3."""
    if name is None:
        return None
    key = str(name).strip().lower()
    if key in ("auto", ""):
        return None
    if key in ("fp8", "fp8_e4m3", "float8_e4m3fn"):
        return "fp8"
    raise UnsupportedOptionError(
        f"kv_cache_dtype {name!r} is not supported; use auto or fp8", param="kv_cache_dtype"
    )


def compute_type_method(compute_type: str) -> tuple[str, str | None]:
    """faster-whisper's ``--compute-type`` names -> (float dtype name, quantization method).
    ``int8`` / ``int8_float32`` run int8 linears around float32, ``int8_float16`` /
    ``int8_bfloat16`` around that float type; anything without ``int8`` has no method."""
    name = compute_type.strip().lower()
    if name == "int8":
        return "auto", "int8_w8a8"
    if name.startswith("int8_"):
        rest = name[len("int8_") :]
        return rest, "int8_w8a8"
    if name.startswith("fp8") or name.startswith("float8"):
        return "auto", "fp8_w8a8"
    return name, None


def quantize_model(model: Any, method: str, **kwargs: Any) -> Any:
    """Replace the quantizable linears of a loaded model (:func:`oasr.quantization.apply.quantize_model`)."""
    from oasr.quantization.apply import quantize_model as _quantize

    return _quantize(model, method, **kwargs)

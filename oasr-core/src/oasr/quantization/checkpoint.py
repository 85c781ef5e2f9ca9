"""The quantized native checkpoint: native format version 2.

A version-2 directory is a version-1 native checkpoint (the family's ``oasr_model.json``,
``model.safetensors`` with the float weights, after SmoothQuant's smoothing when a recipe smoothed
them, and the tokenizer assets) plus

* ``quantized.safetensors``: for every quantized linear, ``<name>.qweight`` (int8, or the fp8
  e4m3 bytes as uint8), ``<name>.weight_scale`` (float32, per output channel) and, for layers
  that carry SmoothQuant's divisor, ``<name>.input_scale`` (float32, per input channel);
* a ``quantization`` block in ``oasr_model.json``: ``method``, ``recipe``, ``layers`` (the
  quantized linears), ``kept`` (the family's high-precision linears), ``weights`` (the file
  above) and the recipe's settings (``alpha``, the calibration manifest and how much audio).

Loading (:func:`apply_saved`, called by :class:`oasr.checkpoint.NativeFormat`) builds the float
model through the family's ``from_native``, replaces the listed linears and copies the saved
quantized weights and scales in: no flag is needed, and the outputs are those of the model that
was saved.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError, UnsupportedOptionError

__all__ = ["QUANTIZED_FILE", "apply_saved", "write_quantized"]

QUANTIZED_FILE = "quantized.safetensors"


def write_quantized(model: Any, dst: Path, report: Any, settings: dict[str, Any]) -> None:
    """Add the quantized weights of ``model`` (already quantized: ``report`` is what
    :func:`oasr.quantization.apply.quantize_model` returned) and the ``quantization`` block to the
    native checkpoint at ``dst`` (written from the float model by ``save_native``)."""
    from safetensors.torch import save_file

    from oasr.checkpoint import NATIVE_CONFIG, QUANTIZED_FORMAT_VERSION
    from oasr.layers.quantized import QuantizedLinear
    from oasr.quantization.apply import networks

    tensors = {}
    for name in report.quantized:
        module = _module(networks(model), name)
        if not isinstance(module, QuantizedLinear):
            raise CheckpointError(f"{name} is not quantized")
        tensors[f"{name}.qweight"] = module.qweight.detach().cpu().contiguous()
        tensors[f"{name}.weight_scale"] = module.weight_scale.detach().float().cpu().contiguous()
        if module.input_scale is not None:
            tensors[f"{name}.input_scale"] = module.input_scale.detach().float().cpu().contiguous()
    save_file(tensors, str(dst / QUANTIZED_FILE))
    body = json.loads((dst / NATIVE_CONFIG).read_text())
    body["format_version"] = QUANTIZED_FORMAT_VERSION
    body["quantization"] = {
        "method": report.method,
        "layers": list(report.quantized),
        "kept": list(report.kept),
        "weights": QUANTIZED_FILE,
        **settings,
    }
    (dst / NATIVE_CONFIG).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def _module(nets: dict[str, Any], name: str) -> Any:
    attr, _, rest = name.partition(".")
    if "" in nets:  # the model is itself the network
        return nets[""].get_submodule(name)
    if attr not in nets:
        raise CheckpointError(f"the model has no network {attr!r} (quantized layer {name})")
    return nets[attr].get_submodule(rest)


def apply_saved(model: Any, path: Path, block: dict[str, Any], requested: str | None) -> Any:
    """Quantize ``model`` (just built from the float weights of ``path``) as the checkpoint says
    and load the saved quantized weights. ``requested``: ``EngineConfig.quantization``, which
    must be unset or the checkpoint's method."""
    import torch
    from safetensors.torch import load_file

    from oasr.quantization import check_method
    from oasr.quantization.apply import networks, no_int8_gemm_kept, quantize_model, start_prepack

    method = check_method(block.get("method"))
    if method is None:
        raise CheckpointError(f"{path}: its quantization block names no method")
    if requested is not None and requested != method:
        raise UnsupportedOptionError(
            f"{path} is quantized with {method}; load it without --quantization (or with "
            f"{method}), or quantize the original checkpoint with {requested}",
            param="quantization",
        )
    try:
        saved = load_file(str(path / block.get("weights", QUANTIZED_FILE)))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types
        raise CheckpointError(f"cannot read the quantized weights of {path}: {exc}") from exc
    scales = {k[: -len(".input_scale")]: v for k, v in saved.items() if k.endswith(".input_scale")}
    expected = list(block.get("layers", []))
    # a family's tied output projection as it was saved: a checkpoint written before OASR
    # quantized it, or on a device where it stays float, keeps it float
    tied = {f"{attr}.{name}" if attr else name for attr, net in networks(model).items()
            for name in (getattr(net, "quantization_tied", None) or {})}  # fmt: skip
    # the linears a family keeps float without an int8 GEMM, as they were saved whatever this
    # CPU (written on a CPU without one: float; elsewhere: quantized)
    device_keep = not (no_int8_gemm_kept(model) & set(expected))
    report = quantize_model(model, method, input_scales=scales, tied=bool(tied & set(expected)), prepack=False,
                            no_int8_gemm_keep=device_keep)  # fmt: skip
    if sorted(report.quantized) != sorted(expected):
        extra = sorted(set(report.quantized) ^ set(expected))[:6]
        raise CheckpointError(
            f"{path}: the quantized layers saved do not match this model's ({extra}...); "
            f"quantize the original checkpoint again with this OASR"
        )
    nets = networks(model)
    with torch.no_grad():
        for name in expected:
            module = _module(nets, name)
            for field in ("qweight", "weight_scale"):
                key = f"{name}.{field}"
                if key not in saved:
                    raise CheckpointError(f"{path}: {QUANTIZED_FILE} lacks {key}")
                target = getattr(module, field)
                if tuple(saved[key].shape) != tuple(target.shape) or saved[key].dtype != target.dtype:
                    raise CheckpointError(f"{path}: {key} has shape {tuple(saved[key].shape)} "
                                          f"{saved[key].dtype}, the model wants {tuple(target.shape)} {target.dtype}")  # fmt: skip
                target.copy_(saved[key])
    start_prepack(report, (_module(nets, name) for name in expected))  # the saved weights, now in place
    report.settings = {k: v for k, v in block.items() if k not in ("layers", "kept")}  # type: ignore[attr-defined]
    return report

"""``oasr quantize``'s recipes: load a checkpoint, calibrate when the recipe does, quantize, write
the version-2 native checkpoint (:mod:`oasr.quantization.checkpoint`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError, InvalidRequestError

__all__ = ["RECIPE_METHODS", "quantize_checkpoint"]

#: recipe -> (method, smoothed)
RECIPE_METHODS = {
    "smoothquant_w8a8": ("int8_w8a8", True),
    "smoothquant_fp8": ("fp8_w8a8", True),
    "w8a8": ("int8_w8a8", False),
    "fp8": ("fp8_w8a8", False),
}


def quantize_checkpoint(src: str | Path, dst: str | Path, recipe: str, *, alpha: float = 0.5,
                        calib_manifest: str | Path | None = None, calib_seconds: float = 600.0,
                        device: str = "cpu", model: Any = None) -> str:  # fmt: skip
    """Write ``src`` quantized by ``recipe`` to ``dst``; returns a one-line summary. ``model``:
    an already loaded float model of ``src`` (tests), else it is loaded on ``device`` in
    float32."""
    from oasr.checkpoint import load_model
    from oasr.model import SupportsNativeFormat
    from oasr.quantization.apply import quantizable_linears, quantize_model
    from oasr.quantization.checkpoint import write_quantized
    from oasr.quantization.smoothquant import calibrate, read_manifest, smoothing_scales
    from oasr.types import EngineConfig

    if recipe not in RECIPE_METHODS:
        raise InvalidRequestError(f"recipe {recipe!r}: use one of {', '.join(RECIPE_METHODS)}", param="recipe")
    method, smoothed = RECIPE_METHODS[recipe]
    dst = Path(dst)
    files = read_manifest(calib_manifest, calib_seconds) if smoothed and calib_manifest else None
    if smoothed and files is None:
        raise InvalidRequestError(f"recipe {recipe} needs a calibration manifest", param="calib_manifest")
    if model is None:
        model = load_model(EngineConfig(ckpt_dir=str(src), device=device, dtype="float32"))
    if getattr(model, "quantization", None) is not None:
        raise CheckpointError(f"{src} is quantized already; quantize the original checkpoint")
    if not isinstance(model, SupportsNativeFormat):
        raise CheckpointError(f"{model.name} does not support the native format, so it cannot be written quantized")
    targets = quantizable_linears(model)
    settings: dict[str, Any] = {"recipe": recipe}
    scales = None
    if smoothed:
        assert files is not None
        calib = calibrate(model, files, targets)
        scales = smoothing_scales(calib, targets, alpha)
        settings["alpha"] = alpha
        settings["calibration"] = {"manifest": Path(str(calib_manifest)).name, "files": calib.files,
                                   "seconds": round(calib.seconds, 1)}  # fmt: skip
        settings["unsmoothed"] = sorted(set(targets) - set(scales))
    before = set(dst.rglob("*")) if dst.is_dir() else set()
    dst.mkdir(parents=True, exist_ok=True)
    arch = model.save_native(dst)  # the float weights (the smoothing divisors travel with the layers)
    report = quantize_model(model, method, input_scales=scales)
    write_quantized(model, dst, report, settings)
    umask = os.umask(0)
    os.umask(umask)
    for f in set(dst.rglob("*")) - before:
        if f.is_file():
            f.chmod(0o666 & ~umask)
    calib_note = ""
    if smoothed:
        c = settings["calibration"]
        calib_note = f", SmoothQuant alpha {alpha} on {c['files']} file(s), {c['seconds']:.0f} s of audio"
        if settings["unsmoothed"]:
            calib_note += f" ({len(settings['unsmoothed'])} layer(s) the audio never reached: unsmoothed)"
    return (f"wrote {arch} checkpoint to {dst}: {method}, {len(report.quantized)} linear layers "
            f"quantized, {len(report.kept)} kept in float{calib_note}")

"""Calibrated quantization: SmoothQuant (Xiao et al., 2023) for every family, through hooks.

1. Calibration: the float model transcribes real audio (a manifest) while a forward pre-hook on
   every linear that will be quantized records the largest ``|x|`` of each input channel over
   every token it sees.
2. Smoothing: per linear, ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (``max|W_j|`` over the
   output channels), clamped to ``[1e-5, 1e5]``. Layers the calibration never reached are
   quantized without smoothing (the checkpoint lists them). Activation outliers, which dominate a token's
   int8 range, are divided by ``s``; the weight's input channel ``j`` is multiplied by it, so
   the float product is unchanged and the quantization difficulty moves from activations to
   weights. ``alpha`` 0.5 splits it evenly.
3. Where the divisor goes: here it stays with the layer (``QuantizedLinear.input_scale``, one
   elementwise division before the activation is quantized). Folding it into the preceding
   LayerNorm / linear would save that division but needs the family's graph (which norm feeds
   which projections, and nothing else): not done yet (docs/quantization.md).
4. The layers are then quantized as the online method does (per-channel weights, per-token
   activations), and :func:`oasr.quantization.checkpoint.write_quantized` writes them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from oasr.errors import InvalidRequestError

__all__ = ["Calibration", "calibrate", "read_manifest", "smoothing_scales"]


@dataclass
class Calibration:
    """Per-input-channel activation maxima (float32 (K,)) by linear name
    (``"<network attr>.<module name>"``), and how much audio produced them."""

    act_max: dict[str, torch.Tensor]
    files: int
    seconds: float


def read_manifest(path: str | Path, limit_seconds: float | None = None) -> list[Path]:
    """The audio files of a JSON-lines manifest: one object per line with ``audio`` (or NeMo's
    ``audio_filepath``, or ``path``); relative paths are relative to the manifest's directory.
    ``limit_seconds``: stop once the lines' ``duration_s`` / ``duration`` add up to it (lines
    without a duration count 30 s)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError(f"--calib-manifest {path}: {exc.strerror or exc}", param="calib_manifest") from exc
    files: list[Path] = []
    total = 0.0
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            name = row.get("audio") or row.get("audio_filepath") or row["path"]
        except (ValueError, KeyError, AttributeError, TypeError):
            raise InvalidRequestError(
                f"{path}:{n}: not a JSON object with an 'audio' (or 'audio_filepath') field",
                param="calib_manifest",
            ) from None
        f = Path(name) if Path(name).is_absolute() else path.parent / name
        if not f.is_file():
            raise InvalidRequestError(f"{path}:{n}: {f} does not exist", param="calib_manifest")
        files.append(f)
        total += float(row.get("duration_s") or row.get("duration") or 30.0)
        if limit_seconds is not None and total >= limit_seconds:
            break
    if not files:
        raise InvalidRequestError(f"{path} lists no audio", param="calib_manifest")
    return files


def calibrate(model: Any, files: Iterable[Path], targets: Mapping[str, torch.nn.Module],
              options: Any = None) -> Calibration:  # fmt: skip
    """Transcribe ``files`` with the float ``model`` and record, for each linear in ``targets``
    (name -> module), the largest ``|x|`` of each input channel."""
    from oasr.audio import load_audio
    from oasr.types import DecodingOptions

    act_max: dict[str, torch.Tensor] = {}
    handles = []

    def hook_for(name: str):  # noqa: ANN202
        def hook(_module: torch.nn.Module, args: tuple) -> None:
            x = args[0].detach()
            m = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float().cpu()
            prev = act_max.get(name)
            act_max[name] = m if prev is None else torch.maximum(prev, m)

        return hook

    for name, module in targets.items():
        handles.append(module.register_forward_pre_hook(hook_for(name)))
    rate = model.feature_spec.sample_rate
    seconds = 0.0
    count = 0
    try:
        opts = options or DecodingOptions()
        for f in files:
            wave = load_audio(str(f), rate)
            seconds += len(wave) / rate
            count += 1
            with torch.no_grad():
                model.transcribe([wave], opts)
    finally:
        for h in handles:
            h.remove()
    if not act_max:
        raise InvalidRequestError("the calibration audio ran none of the layers to quantize", param="calib_manifest")
    return Calibration(act_max, count, seconds)


def smoothing_scales(calib: Calibration, targets: Mapping[str, torch.nn.Module],
                     alpha: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """SmoothQuant's per-input-channel divisor (float32 (K,)) of each target linear that the
    calibration ran; a layer it never reached (WeNet's attention decoder when calibration
    decodes with CTC) gets none and is quantized unsmoothed."""
    if not 0.0 <= alpha <= 1.0:
        raise InvalidRequestError(f"--alpha {alpha}: use a value in [0, 1]", param="alpha")
    scales = {}
    for name, module in targets.items():
        if name not in calib.act_max:
            continue
        a = calib.act_max[name].clamp_min(1e-5)
        w = module.weight.detach().float().abs().amax(dim=0).cpu().clamp_min(1e-5)
        s = (a.pow(alpha) / w.pow(1.0 - alpha)).clamp(1e-5, 1e5)
        scales[name] = s
    return scales

"""``oasr quantize SRC DST``: write a quantized native checkpoint (format version 2) that loads
with no further flag. Torch is imported only when the command runs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from oasr.errors import OASRError
from oasr.quantization import RECIPES

err_console = Console(stderr=True, soft_wrap=True)

_RECIPE_HELP = f"{', '.join(RECIPES)} (see above)."


def quantize(
    src: Annotated[str, typer.Argument(help="Source checkpoint: directory, file or Hub id (any format).")],
    dst: Annotated[Path, typer.Argument(help="Directory to write the quantized native checkpoint to.")],
    recipe: Annotated[str, typer.Option("--recipe", metavar="NAME", help=_RECIPE_HELP)] = "smoothquant_w8a8",
    alpha: Annotated[float, typer.Option("--alpha", min=0.0, max=1.0,
                                         help="SmoothQuant migration strength: 0 leaves activations "
                                         "as they are, 1 moves all of their range to the weights.")] = 0.5,
    calib_manifest: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--calib-manifest", metavar="JSONL",
        help="Calibration audio: one JSON object per line with 'audio' (or 'audio_filepath'), paths "
        "relative to the manifest. Needed by the smoothquant recipes.")] = None,
    calib_seconds: Annotated[float, typer.Option("--calib-seconds", min=1.0,
                                                 help="Use the manifest's first N seconds of audio.")] = 600.0,
    device: Annotated[str, typer.Option("--device", metavar="DEVICE",
                                        help="Where calibration runs: cpu or cuda[:N].")] = "cpu",
) -> None:
    """Quantize a checkpoint's linear layers (W8A8) into a native checkpoint that loads quantized.

    The family's high-precision layers (first and last projections, the joiner / CTC head) stay in float; `oasr transcribe --model DST` then runs it quantized with no flag. Recipes:

    smoothquant_w8a8: SmoothQuant on the --calib-manifest audio, then int8 weights (per output channel) and int8 activations (per token); CPU and CUDA.

    smoothquant_fp8: the same smoothing, then fp8 e4m3; CUDA compute capability >= 8.9.

    w8a8, fp8: no calibration (the online --quantization methods, written to disk).
    """  # noqa: E501 - typer keeps the docstring's line breaks: one line per paragraph
    from rich.markup import escape

    def fail(message: str) -> typer.Exit:
        err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
        return typer.Exit(1 if not message.startswith("--") else 2)

    if recipe not in RECIPES:
        raise fail(f"--recipe {recipe}: use one of {', '.join(RECIPES)}")
    if recipe.startswith("smoothquant") and calib_manifest is None:
        raise fail(f"--recipe {recipe} needs --calib-manifest (real audio for the activation statistics)")
    if dst.exists() and not dst.is_dir():
        raise fail(f"{dst} exists and is not a directory; give a new or existing directory")
    parent = dst if dst.exists() else next((p for p in dst.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise fail(f"cannot write to {parent}")
    from oasr.quantization.recipes import quantize_checkpoint

    try:
        summary = quantize_checkpoint(src, dst, recipe, alpha=alpha, calib_manifest=calib_manifest,
                                      calib_seconds=calib_seconds, device=device)  # fmt: skip
    except OASRError as exc:
        raise fail(exc.message) from None
    except OSError as exc:
        raise fail(f"cannot write {exc.filename or dst}: {exc.strerror or exc}") from None
    err_console.print(escape(summary), highlight=False)

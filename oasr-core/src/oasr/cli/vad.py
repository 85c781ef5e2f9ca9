"""``oasr vad FILE...``: speech segments of audio files (rich table, or with ``--json`` a JSON
list of one object per input, each with its ``file``, whatever the number of inputs).

numpy, torch and the detector are imported only when the command runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from oasr.errors import OASRError

console = Console()
err_console = Console(stderr=True, soft_wrap=True)


def _segment_files(
    files: list[Path],
    *,
    detector_key: str,
    checkpoint: str | None,
    sample_rate: int,
    device: str,
    options: dict[str, Any],
) -> list[dict[str, Any]]:
    from oasr.audio import load_audio
    from oasr.vad import SegmentationOptions, get_detector, get_speech_segments

    opts = SegmentationOptions(**options)
    kwargs: dict[str, Any] = {"device": device}
    if checkpoint is not None:
        kwargs["checkpoint"] = checkpoint
    detector = get_detector(detector_key, **kwargs)
    results = []
    for f in files:
        audio = load_audio(str(f), sample_rate)
        segs = get_speech_segments(audio, sample_rate, detector, opts)
        results.append(
            {
                "file": str(f),
                "sample_rate": sample_rate,
                "duration_s": round(len(audio) / sample_rate, 4),
                "speech_s": round(sum(s.duration_s for s in segs), 4),
                "segments": [s.to_dict() for s in segs],
            }
        )
    return results


def register(app: typer.Typer) -> None:
    @app.command("vad")
    def vad(
        files: Annotated[list[Path], typer.Argument(help="Audio files (any format FFmpeg reads).")],
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
        threshold: Annotated[float, typer.Option(help="Speech probability threshold.")] = 0.5,
        neg_threshold: Annotated[
            Optional[float],  # noqa: UP045 - typer reads annotations
            typer.Option(help="Exit threshold once in speech (default threshold - 0.15)."),
        ] = None,
        min_speech_ms: Annotated[float, typer.Option(help="Drop shorter segments.")] = 250,
        min_silence_ms: Annotated[float, typer.Option(help="Silence that ends a segment.")] = 100,
        speech_pad_ms: Annotated[float, typer.Option(help="Padding on each side.")] = 30,
        max_speech_s: Annotated[
            float, typer.Option(help="Split longer segments at their longest silence.")
        ] = math.inf,
        sample_rate: Annotated[
            int, typer.Option("--sample-rate", help="Rate to analyse at (16000 or 8000).")
        ] = 16000,
        detector: Annotated[str, typer.Option(help="VAD detector key.")] = "silero",
        checkpoint: Annotated[
            Optional[str],  # noqa: UP045
            typer.Option(help="Detector weights (.jit / .safetensors); default: the package's."),
        ] = None,
        device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    ) -> None:
        """Detect speech segments in audio files."""
        from rich.markup import escape

        from oasr.cli.transcribe import check_device, check_input

        problems = [p for p in (check_input(f) for f in files) if p]
        try:
            check_device(device)
        except OASRError as exc:
            problems.append(exc.message)
        for problem in problems:
            err_console.print(f"[red]error:[/red] {escape(problem)}", highlight=False)
        if problems:
            raise typer.Exit(2)
        options = {
            "threshold": threshold,
            "neg_threshold": neg_threshold,
            "min_speech_ms": min_speech_ms,
            "min_silence_ms": min_silence_ms,
            "speech_pad_ms": speech_pad_ms,
            "max_speech_s": max_speech_s,
        }
        try:
            results = _segment_files(
                files, detector_key=detector, checkpoint=checkpoint, sample_rate=sample_rate,
                device=device, options=options,
            )
        except OASRError as exc:
            err_console.print(f"[red]error:[/red] {exc.message}", highlight=False)
            raise typer.Exit(1) from None
        if as_json:  # always a list, one object (with its "file") per input
            typer.echo(json.dumps(results, indent=2))
            return
        for res in results:
            table = Table(title=f"{res['file']}  ({res['speech_s']:.2f} s speech of "
                          f"{res['duration_s']:.2f} s)")
            for col in ("#", "start (s)", "end (s)", "duration (s)"):
                table.add_column(col, justify="right")
            for i, s in enumerate(res["segments"], 1):
                table.add_row(str(i), f"{s['start_s']:.3f}", f"{s['end_s']:.3f}",
                              f"{s['end_s'] - s['start_s']:.3f}")
            console.print(table)


__all__ = ["register"]

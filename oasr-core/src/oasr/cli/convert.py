"""``oasr convert SRC DST`` and its stand-alone twin ``oasr-convert SRC DST``: one function.

Torch is imported only when the conversion runs, so ``oasr-convert --help`` stays fast.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from oasr.errors import OASRError

err_console = Console(stderr=True)


def convert(
    src: Annotated[str, typer.Argument(help="Source checkpoint: directory, file or Hub id.")],
    dst: Annotated[Path, typer.Argument(help="Directory to write OASR's native format to.")],
) -> None:
    """Convert a checkpoint to OASR's native format (safetensors + json + tokenizer)."""
    from oasr.checkpoint import convert_checkpoint

    try:
        arch = convert_checkpoint(src, dst)
    except OASRError as exc:
        err_console.print(f"[red]error:[/red] {exc.message}", highlight=False)
        raise typer.Exit(1) from None
    err_console.print(f"wrote {arch} checkpoint to {dst}")


def main(argv: Optional[list[str]] = None) -> None:  # noqa: UP045 - typer reads annotations
    """Console-script entry point of ``oasr-convert``."""
    app = typer.Typer(name="oasr-convert", add_completion=False, pretty_exceptions_enable=False)
    app.command(help=convert.__doc__)(convert)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="oasr-convert")


if __name__ == "__main__":  # pragma: no cover
    main()

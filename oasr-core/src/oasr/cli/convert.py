"""``oasr convert SRC DST`` and its stand-alone twin ``oasr-convert SRC DST``: one function.

Torch is imported only when the conversion runs, so ``oasr-convert --help`` stays fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from oasr.errors import OASRError

err_console = Console(stderr=True, soft_wrap=True)


def convert(
    src: Annotated[str, typer.Argument(help="Source checkpoint: directory, file or Hub id.")],
    dst: Annotated[Path, typer.Argument(help="Directory to write OASR's native format to.")],
) -> None:
    """Convert a checkpoint to OASR's native format (safetensors + json + tokenizer)."""
    from rich.markup import escape

    def fail(message: str) -> typer.Exit:
        err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
        return typer.Exit(1)

    # checked before the (slow) load
    if dst.exists() and not dst.is_dir():
        raise fail(f"{dst} exists and is not a directory; give a new or existing directory")
    parent = dst if dst.exists() else next((p for p in dst.parents if p.exists()), Path("."))
    if not os.access(parent, os.W_OK):
        raise fail(f"cannot write to {parent}")
    from oasr.checkpoint import convert_checkpoint

    try:
        arch = convert_checkpoint(src, dst)
    except OASRError as exc:
        raise fail(exc.message) from None
    except OSError as exc:
        raise fail(f"cannot write {exc.filename or dst}: {exc.strerror or exc}") from None
    err_console.print(f"wrote {arch} checkpoint to {escape(str(dst))}", highlight=False)


def main(argv: Optional[list[str]] = None) -> None:  # noqa: UP045 - typer reads annotations
    """Console-script entry point of ``oasr-convert``."""
    app = typer.Typer(name="oasr-convert", add_completion=False, pretty_exceptions_enable=False)
    app.command(help=convert.__doc__)(convert)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="oasr-convert")


if __name__ == "__main__":  # pragma: no cover
    main()

"""``oasr graph build`` and ``oasr graph info`` (added to the ``oasr`` app by this plugin's
``register_commands`` hook). kaldifst and numpy are imported only when a command runs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

graph_app = typer.Typer(help="Build and inspect WFST decoding graphs (TLG) for CTC models.",
                        no_args_is_help=True)  # fmt: skip


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


@graph_app.command("build")
def build_command(
    lexicon: Annotated[Path, typer.Option("--lexicon", "-l", help="word unit unit ... per line")],
    lm: Annotated[Path, typer.Option("--lm", help="ARPA n-gram language model (.arpa or .arpa.gz)")],
    output: Annotated[Path, typer.Option("--output", "-o", help="graph image to write (.npz)")],
    tokens: Annotated[Optional[Path], typer.Option(  # noqa: UP045 - typer reads annotations
        "--tokens", help="the model's token table (icefall tokens.txt: 'unit id', 0 = blank); "
        "default: <blk> + the lexicon's units, sorted")] = None,
    vocab: Annotated[Optional[Path], typer.Option(  # noqa: UP045
        "--vocab", help="keep only these words (one a line)")] = None,
) -> None:
    """Build TLG = T o min(det(L o G)) with kaldifst and write it as a graph image."""
    from oasr.errors import OASRError
    from oasr_decoders_wfst.build import build_from_files
    from oasr_decoders_wfst.graph import save_graph

    for name, path in (("lexicon", lexicon), ("lm", lm), ("tokens", tokens), ("vocab", vocab)):
        if path is not None and not path.is_file():
            raise _fail(f"--{name} {str(path)!r} does not exist")
    words = None
    if vocab is not None:
        words = [w for line in vocab.read_text(encoding="utf-8").splitlines() for w in line.split()[:1]]
    start = time.perf_counter()
    try:
        graph = build_from_files(lexicon, lm, tokens, words)
    except OASRError as exc:
        raise _fail(exc.message) from None
    save_graph(graph, output)
    typer.echo(f"wrote {output}: {graph.num_states} states, {graph.num_arcs} arcs, "
               f"{len(graph.words) - 1} words, {graph.num_tokens} tokens "
               f"({time.perf_counter() - start:.1f} s)")  # fmt: skip


@graph_app.command("info")
def info_command(
    graph_path: Annotated[Path, typer.Argument(help="graph image (.npz)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Sizes and tables of a graph image."""
    from oasr.errors import OASRError
    from oasr_decoders_wfst.graph import load_graph

    try:
        graph = load_graph(graph_path)
    except OASRError as exc:
        raise _fail(exc.message) from None
    info = {"states": graph.num_states, "arcs": graph.num_arcs, "words": len(graph.words) - 1,
            "tokens": graph.num_tokens, "start": graph.start, "info": graph.info}  # fmt: skip
    if as_json:
        typer.echo(json.dumps(info, indent=2))
    else:
        for key, value in info.items():
            typer.echo(f"{key}: {value}")

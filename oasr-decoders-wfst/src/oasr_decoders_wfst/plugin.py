"""Hook module named by the ``oasr`` entry point. Must stay light: no torch, numpy or kaldifst
import here."""

from __future__ import annotations

from typing import Any

from oasr import hookimpl
from oasr.hookspecs import Register


@hookimpl
def register_decoders(register: Register) -> None:
    # the call core's oasr.decoders.graph_search makes (model option wfst_graph=...)
    register("wfst", "oasr_decoders_wfst.search:graph_search", decode_family="ctc",
             description="WFST (TLG) token-passing beam search, batched and streaming, GPU or CPU")  # fmt: skip


@hookimpl
def register_commands(cli: Any) -> None:
    from oasr_decoders_wfst.cli import graph_app

    cli.add_typer(graph_app, name="graph")

"""Hook module for the ``oasr`` entry-point group: adds ``oasr serve``. Light on purpose: the
command's module (typer only) is imported when the ``oasr`` CLI is built, the server itself only
when the command runs."""

from __future__ import annotations

from typing import Any

from oasr import hookimpl


@hookimpl
def register_commands(cli: Any) -> None:
    from oasr_server.cli import serve_command

    cli.command("serve")(serve_command)

"""``oasr``: list plugins and models, transcribe and translate files, convert checkpoints.

Heavy work (torch, models) is imported inside the commands that need it, so ``oasr --help``
and the listing commands stay fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from oasr._version import __version__
from oasr.defaults import install_hint
from oasr.errors import OASRError
from oasr.plugins import get_plugin_manager
from oasr.registry import CAPABILITY_FIELDS, KNOWN_PLUGINS

app = typer.Typer(
    name="oasr",
    help="OASR: open automatic speech recognition. Transcribe audio with any installed model family.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console()
#: stderr: messages are never wrapped (a ``pip install`` line stays one line when piped)
err_console = Console(stderr=True, soft_wrap=True)


def _plain_help_types() -> None:
    """Typer's rich help shows a Python type after every parameter (``<bool>`` after each flag,
    ``<list[Path]>`` after an argument that already reads ``FILES...``): show none for flags
    and arguments (options keep their metavar or choices)."""
    from typer import core

    option = getattr(core.TyperOption, "display_type_rich", None)
    if option is None or getattr(option, "_oasr", False):
        return

    def option_type(self, ctx):  # noqa: ANN001, ANN202
        if getattr(self, "is_flag", False) and self.metavar is None:
            return None
        return option(self, ctx)

    def argument_type(self, ctx):  # noqa: ANN001, ANN202
        return None  # the name column shows the argument (FILE..., SRC)

    option_type._oasr = True  # type: ignore[attr-defined]
    core.TyperOption.display_type_rich = option_type  # type: ignore[method-assign]
    core.TyperArgument.display_type_rich = argument_type  # type: ignore[method-assign]


_plain_help_types()


def _warn_plugin_failures() -> None:
    """In the CLI a broken plugin is a warning, printed once per failure: the rest keeps
    working. A command that needs what the plugin would have provided fails with its error."""
    for failure in get_plugin_manager().unreported_failures():
        err_console.print(f"[yellow]warning:[/yellow] {failure.message}", highlight=False)


def fail(error: OASRError | str, code: int = 1) -> typer.Exit:
    from rich.markup import escape

    message = error.message if isinstance(error, OASRError) else error
    err_console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    return typer.Exit(code)


def _version_callback(value: bool) -> None:
    if value:
        console.print(f"oasr {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Show the version."),
    ] = False,
) -> None:
    """OASR command line."""


def _jsonable(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict) or hasattr(value, "items"):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


@app.command("plugins")
def plugins_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List installed plugin distributions, their versions, hooks and what they register."""
    manager = get_plugin_manager()
    manager.load()
    _warn_plugin_failures()
    rows = [
        {
            "distribution": info.distribution,
            "version": info.version,
            "module": info.module,
            "hooks": info.hooks,
            "registered": info.registered,
        }
        for info in sorted(manager.plugins.values(), key=lambda i: i.distribution)
    ]
    failed = [{"distribution": f.distribution, "error": f.message} for f in manager.failures]
    if as_json:
        print(json.dumps({"plugins": rows, "failed": failed}, indent=2))
        return
    table = Table(title="OASR plugins")
    for col in ("distribution", "version", "hooks", "registers"):
        table.add_column(col)
    for row in rows:
        registers = "\n".join(f"{axis}: {', '.join(keys)}" for axis, keys in row["registered"].items())
        table.add_row(row["distribution"], row["version"], "\n".join(row["hooks"]), registers)
    for fail_row in failed:
        table.add_row(fail_row["distribution"], "-", "-", "[red]failed to load[/red] (see the warning)")
    console.print(table)


def list_architectures() -> list[dict[str, Any]]:
    """Every architecture known, by canonical key: installed ones from the registry (with the
    capabilities their plugin declares), first-party ones that are not installed from the
    catalogue (with the pip line that provides them; what they can do is unknown until then)."""
    registry = get_plugin_manager().registry("architecture")
    out: dict[str, dict[str, Any]] = {}
    for spec in registry:
        caps = spec.capabilities
        row: dict[str, Any] = {"architecture": spec.key, "aliases": list(spec.aliases)}
        for name in CAPABILITY_FIELDS:
            value = getattr(caps, name, None)
            row[name] = getattr(value, "value", value)  # DecodeFamily -> "ctc"
        out[spec.key] = {
            **row,
            "source_formats": list(spec.metadata.get("source_formats", [])),
            "description": spec.metadata.get("description", ""),
            "distribution": spec.distribution,
            "installed": True,
            "install": None,
            "install_hint": None,
        }
    for key, known in KNOWN_PLUGINS["architecture"].items():
        if key in out:
            continue
        out[key] = {
            "architecture": key,
            "aliases": list(known.aliases),
            **dict.fromkeys(CAPABILITY_FIELDS),
            "source_formats": [],
            "description": known.description,
            "distribution": known.distribution,
            "installed": False,
            "install": f"pip install {known.distribution}",
            "install_hint": install_hint(known.distribution),
        }
    return [out[k] for k in sorted(out)]


@app.command("models")
def models_command(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """List every known architecture: decode family, modes, formats, and how to install it."""
    rows = list_architectures()
    _warn_plugin_failures()
    if as_json:
        print(json.dumps(_jsonable(rows), indent=2))
        return
    wide = console.width >= 120
    table = Table(title="OASR architectures")
    table.add_column("architecture", no_wrap=True)
    table.add_column("decode")
    table.add_column("modes")
    if wide:
        table.add_column("formats")
    table.add_column("provided by", overflow="fold")

    for r in rows:
        name = r["architecture"]
        if r["aliases"]:
            name += "\n[dim]" + "\n".join(r["aliases"]) + "[/dim]"
        modes = "\n".join(m for m in ("offline", "streaming") if r[m]) or "-"
        if r["installed"]:
            status = f"{r['distribution']} [green](installed)[/green]"
        else:
            hint = r["install_hint"].split(" (", 1)[0]  # the form that works here
            status = f"[dim]not installed: {hint}"
            if hint != r["install"]:
                status += f"\n(elsewhere: {r['install']})"
            status += "[/dim]"
        cells = [name, r["decode_family"] or "-", modes if r["installed"] else "-"]
        if wide:
            cells.append(", ".join(r["source_formats"]) or "-")
        table.add_row(*cells, status)
    console.print(table)


from oasr.cli import transcribe as _transcribe_commands  # noqa: E402  (registers commands)
from oasr.cli import vad as _vad_commands  # noqa: E402

_transcribe_commands.register(app)
_vad_commands.register(app)


def _add_missing_commands() -> None:
    """Commands that other distributions add (``oasr serve``: oasr-server) exist even when
    those are not installed, and say what to install instead of "No such command"."""
    names = {c.name for c in app.registered_commands}
    if "serve" not in names:

        @app.command("serve", context_settings={"ignore_unknown_options": True,
                                                "allow_extra_args": True})  # fmt: skip
        def serve() -> None:
            """Run the HTTP/WebSocket/gRPC server (needs oasr-server)."""
            raise fail(f"oasr serve is provided by oasr-server, which is not installed; install "
                       f"it with: {install_hint('oasr-server')} (then: oasr serve --help)")  # fmt: skip


def main(argv: Optional[list[str]] = None) -> None:  # noqa: UP045 - typer reads annotations
    """Console-script entry point."""
    from oasr.openmp import choose_openmp_wait_policy

    choose_openmp_wait_policy()  # before anything imports torch (issue #27)
    manager = get_plugin_manager()
    try:
        manager.add_commands(app)
    except OASRError as exc:  # two plugins claiming one key: nothing can be trusted to work
        raise SystemExit(f"error: {exc.message}") from None
    _warn_plugin_failures()
    _add_missing_commands()
    try:
        app(args=argv if argv is not None else sys.argv[1:], standalone_mode=True)
    except OASRError as exc:  # library errors reach the user as one clear line
        from rich.markup import escape

        err_console.print(f"[red]error:[/red] {escape(exc.message)}", highlight=False)
        raise SystemExit(1) from None


if __name__ == "__main__":  # pragma: no cover
    main()

__all__ = ["app", "main", "fail", "list_architectures", "Path"]

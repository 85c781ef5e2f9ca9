"""The hook module named by the entry point. It only *names* classes as "module:Class" strings,
so OASR can list them without importing ``oasr_plugin_example.model``.

What the architecture can do is declared once, here: the registration carries ``CAPABILITIES``
and ``EnergyModel.capabilities`` is the same object."""

from __future__ import annotations

from typing import Any

from oasr import hookimpl
from oasr.types import DecodeFamily, ModelCapabilities

CAPABILITIES = ModelCapabilities(decode_family=DecodeFamily.CTC, offline=True, streaming=False)


@hookimpl
def register_architectures(register: Any) -> None:
    register(
        "example_energy",
        "oasr_plugin_example.model:EnergyModel",
        capabilities=CAPABILITIES,
        source_formats=["example-energy"],
        description="Toy energy detector (plugin template)",
    )


@hookimpl
def register_checkpoint_formats(register: Any) -> None:
    register("example-energy", "oasr_plugin_example.model:EnergyFormat", architecture="example_energy")


@hookimpl
def register_commands(cli: Any) -> None:
    @cli.command("example-info")
    def example_info() -> None:
        """Say hello from the example plugin."""
        print("oasr-plugin-example: registers architecture 'example_energy'")

"""The hook module named by the entry point. It only *names* classes as "module:Class" strings,
so OASR can list them without importing torch or the model modules.

Two architectures:

* ``example_energy``: a toy energy detector (numpy only), the smallest thing that satisfies the
  model contract;
* ``example_ctc``: a tiny streaming CTC recogniser written only against oasr-core (network on
  ``oasr.layers``, core's Kaldi fbank, core's CTC decoders, served by core's executors).

What each architecture can do is declared once, here: the registration carries the constant and
the model class's ``capabilities`` is the same object."""

from __future__ import annotations

from typing import Any

from oasr import hookimpl
from oasr.types import DecodeFamily, ModelCapabilities

CAPABILITIES = ModelCapabilities(decode_family=DecodeFamily.CTC, offline=True, streaming=False)
CTC_CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.CTC, offline=True, streaming=True, word_timestamps=True
)


@hookimpl
def register_architectures(register: Any) -> None:
    register(
        "example_energy",
        "oasr_plugin_example.model:EnergyModel",
        capabilities=CAPABILITIES,
        source_formats=["example-energy"],
        description="Toy energy detector (plugin template)",
    )
    register(
        "example_ctc",
        "oasr_plugin_example.ctc_model:ExampleCTC",
        capabilities=CTC_CAPABILITIES,
        source_formats=["example-ctc"],
        description="Tiny streaming CTC model on oasr.layers (plugin template)",
    )


@hookimpl
def register_checkpoint_formats(register: Any) -> None:
    register("example-energy", "oasr_plugin_example.model:EnergyFormat", architecture="example_energy")
    # detect() must stay cheap and torch-free: this module imports the model only in load()
    register("example-ctc", "oasr_plugin_example.ctc_checkpoint:ExampleCTCFormat", architecture="example_ctc",
             description="example_ctc.json + model.safetensors + units.txt")


@hookimpl
def register_commands(cli: Any) -> None:
    @cli.command("example-info")
    def example_info() -> None:
        """Say hello from the example plugin."""
        print("oasr-plugin-example: registers architectures 'example_energy' and 'example_ctc'")

    @cli.command("example-ctc-checkpoint")
    def example_ctc_checkpoint(directory: str, seed: int = 0) -> None:
        """Write a random-weight example_ctc checkpoint into DIRECTORY (to try the plugin)."""
        from oasr_plugin_example.ctc_checkpoint import write_random_checkpoint

        path = write_random_checkpoint(directory, seed=seed)
        print(f"wrote {path}; try: oasr transcribe --ckpt-dir {path} some.wav")

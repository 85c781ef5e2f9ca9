"""``oasr transcribe`` pauses Python's cyclic garbage collector while torch is imported and the
model loads, then freezes what exists and turns the collector back on (``StartupGC``): off
through the device check (which imports torch) and the model load, on and frozen before the
first input is transcribed, on again when a check fails, untouched with
``OASR_STARTUP_GC_FREEZE=0``."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from oasr.cli import transcribe as cli

from .conftest import SPEECH  # noqa: TID252

CLIP = SPEECH / "en_ls_2830-3980-0043.wav"  # 2 s


@pytest.fixture(autouse=True)
def _collector_restored() -> Iterator[None]:
    assert gc.isenabled()
    yield
    gc.unfreeze()  # the test process's objects back into the collections
    gc.enable()


def test_pause_settle_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    s = cli.StartupGC()
    s.pause()
    assert not gc.isenabled()
    s.settle()
    assert gc.isenabled() and gc.get_freeze_count() > 0
    gc.unfreeze()
    s.settle()  # once only
    assert gc.isenabled() and gc.get_freeze_count() == 0

    monkeypatch.setenv("OASR_STARTUP_GC_FREEZE", "0")
    off = cli.StartupGC()
    off.pause()
    assert gc.isenabled()
    off.settle()
    assert gc.get_freeze_count() == 0


def test_collector_back_on_when_a_check_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []

    def check_device(device: str) -> None:
        seen.append(gc.isenabled())
        raise cli.UsageError("--device nope: stop here")

    monkeypatch.setattr(cli, "check_device", check_device)
    with pytest.raises(cli.typer.Exit):
        cli.run_command(cli.Run(files=[CLIP], decode_processes=0))
    assert seen == [False]
    assert gc.isenabled()


def test_off_through_the_load_on_and_frozen_for_the_audio(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    try:
        from oasr.defaults import default_checkpoint

        default_checkpoint()
    except Exception as exc:  # noqa: BLE001 - the package is missing: say so
        pytest.skip(f"real tiny.en not installed ({exc})")
    import oasr.checkpoint as checkpoint
    from oasr.engine import ASREngine

    seen: dict[str, tuple[bool, int]] = {}
    real_check, real_load, real_run = (
        cli.check_device,
        checkpoint.load_model,
        ASREngine.transcribe_arrays,
    )

    def check_device(device: str) -> None:
        seen["device check"] = (gc.isenabled(), gc.get_freeze_count())
        real_check(device)

    def load_model(config):  # noqa: ANN001, ANN202
        seen["model load"] = (gc.isenabled(), gc.get_freeze_count())
        return real_load(config)

    def transcribe_arrays(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen["transcription"] = (gc.isenabled(), gc.get_freeze_count())
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(cli, "check_device", check_device)
    monkeypatch.setattr(checkpoint, "load_model", load_model)
    monkeypatch.setattr(ASREngine, "transcribe_arrays", transcribe_arrays)
    cli.run_command(
        cli.Run(
            files=[CLIP], fmt="txt", output_dir=str(tmp_path), language="en", decode_processes=0
        )
    )
    assert seen["device check"] == (False, 0)
    assert seen["model load"] == (False, 0)
    enabled, frozen = seen["transcription"]
    assert enabled and frozen > 10_000  # torch's modules, classes, functions
    assert (
        "experience proves this" in (tmp_path / f"{CLIP.stem}.txt").read_text().lower()
    )  # its reference
    assert gc.isenabled()

"""``oasr transcribe`` decodes its inputs in worker processes started before torch is imported
(``EarlyDecode``): the pool starts before the device check imports torch, is forked only while
that is safe, and gives exactly the samples and header durations of decoding in-process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from oasr import decode_pool
from oasr.audio import load_audio
from oasr.cli import transcribe as cli

from .conftest import SPEECH  # noqa: TID252

FILES = [SPEECH / "en_ls_2830-3980-0043.wav", SPEECH / "en_jfk_inaugural.flac",
         SPEECH / "en_fleurs_000.ogg"]  # fmt: skip


class _Engine:
    """What EarlyDecode reads of an engine: its rate and its length check."""

    sample_rate = 16000

    def load_audio(self, audio: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(audio, dtype=np.float32)

    def load_audios(self, files: list[Path]) -> list[np.ndarray]:
        return [load_audio(str(f), self.sample_rate) for f in files]


def test_same_samples_and_durations_as_in_process(tmp_path: Path) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF not audio at all" * 10)
    early = cli.EarlyDecode.start(cli.Run(files=[*FILES, bad]))
    assert early is not None
    try:
        got = early.audios(_Engine(), [*FILES, bad])
        for f, audio in zip(FILES, got, strict=False):
            assert np.array_equal(audio, load_audio(str(f), 16000))
            assert early.declared_seconds(f) == cli.declared_seconds(f)
        assert isinstance(got[-1], Exception)  # the bad input fails alone
    finally:
        early.close()


def test_off_with_decode_processes_0_and_another_rate_decodes_again() -> None:
    assert cli.EarlyDecode.start(cli.Run(files=FILES, decode_processes=0)) is None
    early = cli.EarlyDecode.start(cli.Run(files=FILES[:1]))
    assert early is not None
    try:

        class Engine8k(_Engine):
            sample_rate = 8000

        (audio,) = early.audios(Engine8k(), FILES[:1])
        assert np.array_equal(audio, load_audio(str(FILES[0]), 8000))
    finally:
        early.close()


def test_pool_starts_before_torch_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    """run_command starts the decoding before check_device (which imports torch), and shuts
    the pool down when a later check fails."""
    order: list[str] = []
    started: list[cli.EarlyDecode] = []
    real_start = cli.EarlyDecode.start

    def start(run: cli.Run) -> cli.EarlyDecode | None:
        order.append("decode")
        early = real_start(run)
        started.append(early)
        return early

    def check_device(device: str) -> None:
        order.append("device")
        raise cli.UsageError("--device nope: stop here")

    monkeypatch.setattr(cli.EarlyDecode, "start", staticmethod(start))
    monkeypatch.setattr(cli, "check_device", check_device)
    with pytest.raises(cli.typer.Exit):
        cli.run_command(cli.Run(files=FILES[:2]))
    assert order == ["decode", "device"]
    assert started[0] is not None and started[0].pool._closed


def test_forked_before_torch_in_a_fresh_process() -> None:
    """In a process that has not imported torch (the CLI's, at that point) the workers are
    forked, the samples equal in-process decoding, and torch is still not imported."""
    code = f"""
import sys, numpy as np
from pathlib import Path
from oasr.cli import transcribe as cli
from oasr.audio import load_audio
files = [Path(p) for p in {[str(f) for f in FILES]!r}]
early = cli.EarlyDecode.start(cli.Run(files=files))
assert early.pool._context.get_start_method() == "fork", early.pool._context
class E:
    sample_rate = 16000
    def load_audio(self, a):
        return a
got = early.audios(E(), files)
assert "torch" not in sys.modules
assert all(np.array_equal(a, load_audio(str(f), 16000)) for a, f in zip(got, files))
early.close()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_replaced_pool_is_never_forked() -> None:
    pool = decode_pool.AudioDecodePool(1, start_method="fork")
    try:
        broken = pool._current()  # no worker starts before the first submit
        pool._replace(broken)
        assert pool._context.get_start_method() == decode_pool.default_start_method()
        assert pool.restarts == 1
    finally:
        pool.shutdown()


def test_no_fork_once_torch_is_imported() -> None:
    import torch  # noqa: F401 - this test process has torch

    assert not decode_pool.fork_is_safe()

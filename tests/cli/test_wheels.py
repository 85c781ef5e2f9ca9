"""``scripts/build_wheels.sh`` builds an installable wheel of every distribution (issue #14, item
8): the wheels install into a fresh virtual environment, and ``oasr transcribe`` there works
with the default model and the VAD (package data included).

The fresh environment gets the third-party packages (torch, numpy, PyAV, ...) of the test's own
environment through a folder of links, without any of this repository's distributions, so the
test needs no package index."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
JFK = REPO / "tests" / "data" / "speech" / "en_jfk_inaugural.flac"
OURS = ("oasr", "__editable__", "_oasr", "__pycache__")


def _third_party_site(target: Path) -> Path:
    """A folder linking every package of this environment but this repository's own."""
    site = Path(sysconfig.get_paths()["purelib"])
    target.mkdir()
    for entry in site.iterdir():
        if entry.name.startswith(OURS) or entry.suffix == ".pth":
            continue
        (target / entry.name).symlink_to(entry)
    return target


@pytest.mark.slow
def test_wheels_install_and_transcribe_in_a_fresh_venv(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "build_wheels.sh"), str(dist)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHON": sys.executable},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    wheels = sorted(p.name.split("-")[0] for p in dist.glob("*.whl"))
    expected = sorted(
        p.name.replace("-", "_") for p in REPO.glob("oasr-*") if (p / "pyproject.toml").is_file()
    )
    assert set(expected) <= set(wheels), (expected, wheels)
    assert "pip install --find-links" in proc.stderr
    # the build leaves the source tree as it was: no new *.egg-info (an egg-info beside the
    # example plugin's sources made it register twice in every later test that imports it)
    assert not list((REPO / "examples" / "oasr-plugin-example" / "src").glob("*.egg-info"))

    venv = tmp_path / "venv"
    # no pip inside (ensurepip costs ~10 s CPU): this environment's pip installs into it below
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300
    )
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    deps = _third_party_site(tmp_path / "deps")
    (Path(purelib) / "zz_third_party.pth").write_text(f"{deps}\n")
    # no index, no dependencies: the wheels alone
    install = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
         "--no-index",
         *map(str, dist.glob("oasr_core-*.whl")),
         *map(str, dist.glob("oasr_models_whisper-*.whl")),
         *map(str, dist.glob("oasr_vad_silero-*.whl"))],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    where = subprocess.run(
        [str(py), "-c", "import oasr, oasr_models_whisper, oasr_vad_silero; "
         "print(oasr.__file__, oasr_vad_silero.__file__)"],
        capture_output=True, text=True, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert str(REPO) not in where.stdout and str(venv) in where.stdout
    run = subprocess.run(
        [str(venv / "bin" / "oasr"), "transcribe", str(JFK), "--long-form", "vad"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "ask not what your country can do for you" in run.stdout.lower()
    assert "warning" not in run.stderr, run.stderr

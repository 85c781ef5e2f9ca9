"""Fixtures that expose plugins as *real* installed distributions: a ``*.dist-info`` folder with
``METADATA`` and ``entry_points.txt`` on ``sys.path``, exactly what pip would write, so discovery
goes through ``importlib.metadata`` like in production."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomllib

from oasr.plugins import reset_plugin_manager

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "oasr-plugin-example"


def write_distribution(
    site: Path, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]
) -> Path:
    """Write modules and a dist-info for distribution ``name`` into ``site``."""
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    eps = "\n".join(f"{k} = {v}" for k, v in entry_points.items())
    (dist_info / "entry_points.txt").write_text(f"[oasr]\n{eps}\n")
    for module, source in modules.items():
        path = site / (module.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        for parent in path.relative_to(site).parents:
            if str(parent) != ".":
                (site / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(source))
    return site


def write_example_distribution(site: Path) -> Path:
    """The example plugin as pip would install it: metadata from its real pyproject.toml."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    dist_info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    eps = project["entry-points"]["oasr"]
    (dist_info / "entry_points.txt").write_text(
        "[oasr]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items())
    )
    return site


@pytest.fixture
def fresh_plugins() -> Iterator[None]:
    reset_plugin_manager()
    yield
    reset_plugin_manager()


@pytest.fixture
def example_site(tmp_path: Path) -> Path:
    return write_example_distribution(tmp_path / "site-example")


@pytest.fixture
def example_installed(
    example_site: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> Path:
    """The example plugin installed in this process (its source tree and its dist-info)."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.syspath_prepend(str(example_site))
    for name in [m for m in sys.modules if m.startswith("oasr_plugin_example")]:
        monkeypatch.delitem(sys.modules, name)
    return example_site


@pytest.fixture
def run_oasr() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the ``oasr`` CLI in a fresh interpreter with extra sys.path entries and env vars."""

    def run(*args: str, paths: list[Path] = (), env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("OASR_")}
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(p) for p in paths] + ([full_env["PYTHONPATH"]] if full_env.get("PYTHONPATH") else [])
        )
        full_env["COLUMNS"] = "200"
        full_env.update(env or {})
        return subprocess.run(
            [sys.executable, "-c", "from oasr.cli.main import main; main()", *args],
            capture_output=True, text=True, env=full_env, timeout=120,
        )

    return run

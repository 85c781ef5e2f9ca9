"""Fixtures for kernel provider tests: fake providers installed as real distributions (a
``*.dist-info`` with ``entry_points.txt`` on ``sys.path``), fresh plugin and provider state, and
the override table restored afterwards."""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from oasr import kernel_providers
from oasr.plugins import reset_plugin_manager


def write_distribution(site: Path, name: str, entry_point: str, modules: dict[str, str]) -> Path:
    dist_info = site / f"{name.replace('-', '_')}-0.1.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text(f"[oasr]\nhooks = {entry_point}\n")
    for module, source in modules.items():
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    return site


@pytest.fixture
def clean_providers() -> Iterator[None]:
    """Fresh plugin manager and provider bookkeeping; the override table as it was."""
    import oasr.layers as L

    before = L.list_overrides()
    reset_plugin_manager()
    kernel_providers._reset()
    yield
    reset_plugin_manager()
    kernel_providers._reset()
    for key in L.list_overrides():
        L.unregister_override(*key)
    for key, fn in before.items():
        L.register_override(*key, fn)


@pytest.fixture
def install_fake(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clean_providers: None
) -> Callable[[str, str, dict[str, str]], None]:
    """Install a fake plugin distribution in this process."""

    def install(name: str, entry_point: str, modules: dict[str, str]) -> None:
        site = write_distribution(tmp_path / name, name, entry_point, modules)
        for module in modules:
            monkeypatch.delitem(sys.modules, module, raising=False)
        monkeypatch.syspath_prepend(str(site))

    return install


@pytest.fixture(scope="session")
def cxx20(tmp_path_factory: pytest.TempPathFactory) -> str:
    """g++ with C++20 ``<barrier>`` / ``<bit>`` and ``_Float16``, which the host emulation of the
    CUDA sources needs; skips the test without one."""
    import shutil
    import subprocess

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("needs g++")
    work = tmp_path_factory.mktemp("cxx20_probe")
    probe = work / "probe.cpp"
    probe.write_text("#include <barrier>\n#include <bit>\nint main() { _Float16 h = 1; "
                     "return std::bit_cast<unsigned short>(h) == 0; }\n")  # fmt: skip
    if subprocess.run([cxx, "-std=c++20", str(probe), "-o", str(work / "probe")],
                      capture_output=True).returncode:  # fmt: skip
        pytest.skip("g++ without C++20 <barrier>/<bit> or _Float16")
    return cxx

"""Plugin discovery, lazy loading, error paths and allow/block lists, through real metadata."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from oasr.errors import DuplicateRegistrationError, MissingPluginError, PluginLoadError
from oasr.plugins import get_plugin_manager, get_registry, resolve

from .conftest import EXAMPLE, write_distribution

BROKEN = {
    "oasr_broken_plugin": "raise ImportError('needs libfoo, which is missing')\n",
}
DUPLICATE = {
    "oasr_dup_plugin": """
        from oasr import hookimpl

        @hookimpl
        def register_architectures(register):
            register("whisper", "oasr_dup_plugin:Nothing")
    """,
}


def test_example_is_discovered_but_not_imported(example_installed: Path) -> None:
    registry = get_registry("architecture")
    spec = registry.get("example_energy")
    assert spec.distribution == "oasr-plugin-example"
    assert spec.metadata["decode_family"] == "ctc"
    assert "oasr_plugin_example.plugin" in sys.modules  # the light hook module
    assert "oasr_plugin_example.model" not in sys.modules  # the heavy one waits
    cls = resolve("architecture", "example_energy")
    assert cls.__name__ == "EnergyModel"
    assert "oasr_plugin_example.model" in sys.modules


def test_example_runs_through_the_engine(example_installed: Path, tmp_path: Path) -> None:
    from oasr.engine import ASREngine
    from oasr.types import EngineConfig

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "example_energy.json").write_text(json.dumps({"threshold_db": -30}))
    engine = ASREngine(EngineConfig(ckpt_dir=str(ckpt)))
    t = np.arange(16000) / 16000
    audio = np.concatenate([np.zeros(8000), 0.5 * np.sin(2 * np.pi * 440 * t), np.zeros(8000)])
    (out,) = engine.transcribe_offline(audio.astype(np.float32))
    assert out.text == "[speech]"
    assert out.segments[0].start == pytest.approx(0.5, abs=0.02)
    assert out.segments[0].end == pytest.approx(1.5, abs=0.02)


def test_missing_first_party_key_names_the_distribution(fresh_plugins: None) -> None:
    with pytest.raises(MissingPluginError) as info:
        get_registry("architecture").get("paraformer")
    assert "pip install oasr-models-funasr" in str(info.value)
    with pytest.raises(MissingPluginError) as info:
        get_registry("architecture").get("no_such_model")
    assert "oasr plugins" in str(info.value)


def test_duplicate_key_names_both_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    site = write_distribution(tmp_path, "oasr-dup-plugin", "1.0", {"dup": "oasr_dup_plugin"}, DUPLICATE)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(DuplicateRegistrationError) as info:
        get_registry("architecture")
    message = str(info.value)
    assert "oasr-models-whisper" in message and "oasr-dup-plugin" in message


def test_broken_plugin_raises_in_library(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    site = write_distribution(tmp_path, "oasr-broken-plugin", "0.3", {"b": "oasr_broken_plugin"}, BROKEN)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(PluginLoadError) as info:
        get_registry("architecture")
    assert "oasr-broken-plugin" in str(info.value)
    assert "libfoo" in str(info.value)
    # Non-strict access (what the CLI uses) still works with the healthy plugins.
    assert "whisper" in get_plugin_manager().registry("architecture", strict=False)


def test_broken_plugin_warns_in_cli(tmp_path: Path, run_oasr) -> None:
    site = write_distribution(tmp_path, "oasr-broken-plugin", "0.3", {"b": "oasr_broken_plugin"}, BROKEN)
    proc = run_oasr("models", "--json", paths=[site])
    assert proc.returncode == 0, proc.stderr
    assert "oasr-broken-plugin" in proc.stderr and "warning" in proc.stderr
    assert any(r["architecture"] == "whisper" for r in json.loads(proc.stdout))


def test_cli_lists_example_and_install_hints(example_site: Path, run_oasr) -> None:
    paths = [EXAMPLE / "src", example_site]
    plugins = json.loads(run_oasr("plugins", "--json", paths=paths).stdout)["plugins"]
    example = next(p for p in plugins if p["distribution"] == "oasr-plugin-example")
    assert example["version"] == "0.1.0"
    assert example["hooks"] == ["register_architectures", "register_checkpoint_formats", "register_commands"]
    assert example["registered"]["architecture"] == ["example_energy"]

    models = {r["architecture"]: r for r in json.loads(run_oasr("models", "--json", paths=paths).stdout)}
    assert models["example_energy"]["installed"] is True
    assert models["example_energy"]["distribution"] == "oasr-plugin-example"
    assert models["zipformer_ctc"]["installed"] is False
    assert models["zipformer_ctc"]["install"] == "pip install oasr-models-icefall"

    table = run_oasr("models", paths=paths).stdout
    assert "example_energy" in table and "pip install oasr-models-funasr" in table

    hello = run_oasr("example-info", paths=paths)
    assert hello.returncode == 0 and "example_energy" in hello.stdout


@pytest.mark.parametrize(
    ("env", "expect_example", "expect_whisper"),
    [
        ({"OASR_DISABLE_PLUGINS": "oasr-plugin-example"}, False, True),
        ({"OASR_DISABLE_PLUGINS": "OASR_Models_Whisper,other"}, True, False),
        ({"OASR_PLUGINS": "oasr-plugin-example"}, True, False),
        ({"OASR_PLUGINS": ""}, False, False),
    ],
)
def test_allow_and_block_lists(example_site: Path, run_oasr, env, expect_example, expect_whisper) -> None:
    proc = run_oasr("plugins", "--json", paths=[EXAMPLE / "src", example_site], env=env)
    assert proc.returncode == 0, proc.stderr
    names = {p["distribution"] for p in json.loads(proc.stdout)["plugins"]}
    assert "oasr-core" in names  # built-ins always load
    assert ("oasr-plugin-example" in names) is expect_example
    assert ("oasr-models-whisper" in names) is expect_whisper

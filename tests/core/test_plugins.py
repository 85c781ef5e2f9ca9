"""Plugin discovery, lazy loading, error paths and allow/block lists, through real metadata."""

from __future__ import annotations

import json
import sys
import wave
from pathlib import Path

import numpy as np
import pytest

from oasr import hookimpl
from oasr.errors import DuplicateRegistrationError, MissingPluginError, PluginLoadError
from oasr.plugins import get_plugin_manager, get_registry, resolve, temporary_plugin
from oasr.types import DecodeFamily

from .conftest import EXAMPLE, write_distribution

#: first-party families these tests treat as not installed: blocked here, so the tests hold
#: whichever of them the environment has installed
NOT_INSTALLED = "oasr-models-funasr,oasr-models-icefall,oasr-models-nemo,oasr-models-qwen"


@pytest.fixture(autouse=True)
def _families_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OASR_DISABLE_PLUGINS", NOT_INSTALLED)


BROKEN = {
    "oasr_broken_plugin": "raise ImportError('needs libfoo, which is missing')\n",
}
DUPLICATE = {
    "oasr_dup_plugin": """
        from oasr import hookimpl

        @hookimpl
        def register_architectures(register):
            register("whisper", "oasr_dup_plugin:Nothing", capabilities={"decode_family": "aed"})
    """,
}


def test_example_is_discovered_but_not_imported(example_installed: Path) -> None:
    registry = get_registry("architecture")
    spec = registry.get("example_energy")
    assert spec.distribution == "oasr-plugin-example"
    assert spec.capabilities.decode_family is DecodeFamily.CTC
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
    (out,) = engine.transcribe_arrays([audio.astype(np.float32)])
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


@pytest.mark.parametrize(
    ("alias", "distribution"),
    [("zipformer_ctc", "oasr-models-icefall"), ("zipformer_transducer", "oasr-models-icefall"),
     ("fastconformer_rnnt", "oasr-models-nemo"), ("qwen2_audio", "oasr-models-qwen")],
)
def test_missing_alias_names_the_distribution(fresh_plugins: None, alias: str, distribution: str) -> None:
    with pytest.raises(MissingPluginError) as info:
        get_registry("architecture").get(alias)
    assert f"pip install {distribution}" in str(info.value)


def test_alias_resolves_to_the_same_spec(fresh_plugins: None) -> None:
    registry = get_registry("architecture")
    assert registry.get("wenet_conformer") is registry.get("conformer")
    assert "wenet_conformer" in registry
    assert "wenet_conformer" not in registry.keys()  # listings show canonical keys
    assert registry.canonical("wenet_conformer") == "conformer"
    assert registry.canonical("qwen2_audio") == "speech_llm"  # known even when not installed
    assert resolve("architecture", "wenet_conformer") is resolve("architecture", "conformer")


def test_an_alias_cannot_be_claimed_twice(fresh_plugins: None) -> None:
    class Squatter:
        @hookimpl
        def register_architectures(self, register):
            register("wenet_conformer", "somewhere:Model", capabilities={"decode_family": "ctc"})

    with pytest.raises(DuplicateRegistrationError) as info:
        with temporary_plugin(Squatter(), name="oasr-squatter"):
            pass
    assert "oasr-models-wenet" in str(info.value) and "oasr-squatter" in str(info.value)
    # nothing of the refused plugin is left behind
    assert "oasr-squatter" not in get_plugin_manager().plugins
    assert get_registry("architecture").get("wenet_conformer").distribution == "oasr-models-wenet"


def test_duplicate_key_names_both_distributions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    site = write_distribution(tmp_path, "oasr-dup-plugin", "1.0", {"dup": "oasr_dup_plugin"}, DUPLICATE)
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(DuplicateRegistrationError) as info:
        get_registry("architecture")
    message = str(info.value)
    assert "oasr-models-whisper" in message and "oasr-dup-plugin" in message
    with pytest.raises(DuplicateRegistrationError):  # every access, not only the first
        get_registry("checkpoint_format")


def test_broken_distribution_raises_only_where_it_is_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_plugins: None
) -> None:
    """A real installed distribution whose hook module does not import."""
    site = write_distribution(tmp_path, "oasr-broken-plugin", "0.3", {"b": "oasr_broken_plugin"}, BROKEN)
    monkeypatch.syspath_prepend(str(site))
    registry = get_registry("architecture")  # listing works
    assert registry.get("whisper").distribution == "oasr-models-whisper"  # so do healthy keys
    (failure,) = get_plugin_manager().failures
    assert failure.distribution == "oasr-broken-plugin" and "libfoo" in failure.message
    # a key nobody provides may be the broken plugin's: its error, with what was asked for
    with pytest.raises(PluginLoadError) as info:
        registry.get("broken_model")
    assert "architecture 'broken_model' is not available" in str(info.value)
    assert "oasr-broken-plugin" in str(info.value) and "libfoo" in str(info.value)
    # a first-party key that another distribution provides still names that distribution
    with pytest.raises(MissingPluginError, match="pip install oasr-models-funasr"):
        registry.get("paraformer")


def test_in_memory_plugin_that_fails_to_import(fresh_plugins: None) -> None:
    """A plugin registered in memory by module name, as if it were oasr-models-funasr's hook
    module and could not import: only what it provides is unavailable."""
    manager = get_plugin_manager()
    with temporary_plugin("oasr_models_funasr_missing.plugin", name="oasr-models-funasr"):
        (failure,) = manager.failures
        assert failure.distribution == "oasr-models-funasr"
        assert isinstance(failure.cause, ModuleNotFoundError)
        with pytest.raises(PluginLoadError) as info:
            get_registry("architecture").get("paraformer")
        assert "architecture 'paraformer' is not available" in str(info.value)
        assert "OASR_DISABLE_PLUGINS=oasr-models-funasr" in str(info.value)
        assert get_registry("architecture").get("whisper").distribution == "oasr-models-whisper"
        with pytest.raises(MissingPluginError, match="pip install oasr-models-icefall"):
            get_registry("architecture").get("zipformer")
    assert manager.failures == []  # unregistering forgets its failure
    with pytest.raises(MissingPluginError, match="pip install oasr-models-funasr"):
        get_registry("architecture").get("paraformer")


def test_in_memory_plugin_registers_and_unregisters(fresh_plugins: None) -> None:
    class Toy:
        @hookimpl
        def register_architectures(self, register):
            register("toy", "oasr_plugin_example.model:EnergyModel", aliases=("toy_v0",),
                     capabilities={"decode_family": "ctc", "streaming": True})

    with temporary_plugin(Toy(), name="oasr-toy", version="9.9") as manager:
        spec = get_registry("architecture").get("toy_v0")
        assert (spec.key, spec.distribution, spec.aliases) == ("toy", "oasr-toy", ("toy_v0",))
        assert spec.capabilities.streaming is True and spec.capabilities.decode_family is DecodeFamily.CTC
        info = manager.plugins["oasr-toy"]
        assert (info.version, info.hooks, info.registered) == (
            "9.9", ["register_architectures"], {"architecture": ["toy"]}
        )
    assert "toy" not in get_registry("architecture") and "toy_v0" not in get_registry("architecture")
    assert "oasr-toy" not in get_plugin_manager().plugins


@pytest.mark.parametrize(
    ("registration", "message"),
    [
        ({"decode_family": "ctc", "capabilities": {"decode_family": "ctc"}}, "give capabilities once"),
        ({"source_formats": ["x"]}, "needs capabilities"),
        ({"capabilities": {"decode_family": "ctc", "karaoke": True}}, "unknown capabilities"),
        ({"capabilities": {"decode_family": "telepathy"}}, "telepathy"),
    ],
)
def test_malformed_architecture_registration_is_that_plugins_failure(
    fresh_plugins: None, registration: dict, message: str
) -> None:
    class Sloppy:
        @hookimpl
        def register_architectures(self, register):
            register("sloppy", "sloppy_pkg:Model", **registration)

    with temporary_plugin(Sloppy(), name="oasr-sloppy") as manager:
        (failure,) = manager.failures
        assert failure.distribution == "oasr-sloppy" and message in failure.message
        assert "sloppy" not in get_registry("architecture")
        assert "whisper" in get_registry("architecture")


def test_loose_capability_keywords_fold_into_capabilities(fresh_plugins: None) -> None:
    class Terse:
        @hookimpl
        def register_architectures(self, register):
            register("terse", "terse_pkg:Model", decode_family="transducer", streaming=True)

    with temporary_plugin(Terse(), name="oasr-terse"):
        spec = get_registry("architecture").get("terse")
        assert spec.capabilities.decode_family is DecodeFamily.TRANSDUCER
        assert spec.capabilities.streaming is True
        assert "decode_family" not in spec.metadata  # one place: the capabilities


def test_a_misspelt_hook_is_a_failure(fresh_plugins: None) -> None:
    class Typo:
        @hookimpl
        def register_architecture(self, register):  # no trailing "s"
            register("typo", "typo_pkg:Model", capabilities={"decode_family": "ctc"})

    with temporary_plugin(Typo(), name="oasr-typo") as manager:
        (failure,) = manager.failures
        assert "register_architecture," in failure.message or failure.message.count("register_architecture ")
        assert "oasr-typo" not in manager.plugins


def test_broken_plugin_warns_once_in_cli(tmp_path: Path, run_oasr) -> None:
    site = write_distribution(tmp_path, "oasr-broken-plugin", "0.3", {"b": "oasr_broken_plugin"}, BROKEN)
    for command in (("models", "--json"), ("plugins", "--json")):
        proc = run_oasr(*command, paths=[site])
        assert proc.returncode == 0, proc.stderr
        warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
        assert len(warnings) == 1, proc.stderr
        assert "oasr-broken-plugin" in warnings[0] and "libfoo" in proc.stderr
    assert any(r["architecture"] == "whisper" for r in json.loads(run_oasr("models", "--json", paths=[site]).stdout))
    failed = json.loads(proc.stdout)["failed"]
    assert [f["distribution"] for f in failed] == ["oasr-broken-plugin"]


def test_transcribe_works_next_to_a_broken_plugin(example_site: Path, tmp_path: Path, run_oasr) -> None:
    broken = write_distribution(tmp_path / "broken", "oasr-broken-plugin", "0.3", {"b": "oasr_broken_plugin"}, BROKEN)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "example_energy.json").write_text(json.dumps({"threshold_db": -30}))
    rate = 16000
    t = np.arange(rate) / rate
    audio = np.concatenate([np.zeros(rate // 2), 0.5 * np.sin(2 * np.pi * 440 * t), np.zeros(rate // 2)])
    wav = tmp_path / "tone.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((audio * 32767).astype("<i2").tobytes())
    proc = run_oasr("transcribe", "--ckpt-dir", str(ckpt), str(wav), "--response-format", "text",
                    paths=[EXAMPLE / "src", example_site, broken])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[speech]"
    warnings = [line for line in proc.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "oasr-broken-plugin" in warnings[0], proc.stderr


def test_cli_lists_example_and_install_hints(example_site: Path, run_oasr) -> None:
    paths = [EXAMPLE / "src", example_site]
    plugins = json.loads(run_oasr("plugins", "--json", paths=paths).stdout)["plugins"]
    example = next(p for p in plugins if p["distribution"] == "oasr-plugin-example")
    assert example["version"] == "0.1.0"
    assert example["hooks"] == ["register_architectures", "register_checkpoint_formats", "register_commands"]
    assert example["registered"]["architecture"] == ["example_energy", "example_ctc"]

    absent = {"OASR_DISABLE_PLUGINS": NOT_INSTALLED}
    models = {r["architecture"]: r for r in json.loads(run_oasr("models", "--json", paths=paths, env=absent).stdout)}
    assert models["example_energy"]["installed"] is True
    assert models["example_energy"]["distribution"] == "oasr-plugin-example"
    assert models["zipformer"]["installed"] is False
    assert models["zipformer"]["install"] == "pip install oasr-models-icefall"
    assert models["zipformer"]["aliases"] == ["zipformer_ctc"]
    assert models["zipformer"]["decode_family"] is None  # unknown until installed
    # canonical keys only; an alias is shown as such on its key's row
    assert "zipformer_ctc" not in models and "wenet_conformer" not in models
    assert models["conformer"]["aliases"] == ["wenet_conformer"]
    assert (models["conformer"]["decode_family"], models["conformer"]["streaming"]) == ("ctc", True)
    assert models["whisper"]["translation"] is True
    assert set(models) >= {"conformer", "zipformer", "transducer", "nemotron", "whisper", "paraformer",
                           "speech_llm", "example_energy"}

    table = run_oasr("models", paths=paths, env=absent).stdout
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

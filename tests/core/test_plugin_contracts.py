"""Plugin contracts declared once: capabilities (registration == model class), the optional
Protocols core checks with ``isinstance``, native checkpoints under an old key, and the plugin
documentation covering every hook, metadata key and Protocol core defines."""

from __future__ import annotations

import inspect
import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from oasr import hookimpl, hookspecs
from oasr import model as model_contracts
from oasr.checkpoint import NATIVE_CONFIG, NATIVE_FORMAT_VERSION, convert_checkpoint, load_model
from oasr.errors import CheckpointError
from oasr.model import (
    HasDevice,
    HoldsExtraRequests,
    SupportsExecutor,
    SupportsNativeFormat,
    model_device,
)
from oasr.plugins import get_registry, temporary_plugin
from oasr.registry import CAPABILITY_FIELDS, KNOWN_PLUGINS
from oasr.scheduler import BatchExecutor, Scheduler, SchedulerConfig, executor_for
from oasr.types import (
    DecodeFamily,
    DecodingOptions,
    EngineConfig,
    FeatureSpec,
    ModelCapabilities,
    Transcript,
)

REPO = Path(__file__).resolve().parents[2]
CORE_SRC = REPO / "oasr-core" / "src" / "oasr"
PLUGINS_DOC = REPO / "docs" / "plugins.md"


# -- capabilities: one declaration -----------------------------------------------------------------


def test_registered_capabilities_are_the_model_classes(example_installed: Path) -> None:
    """Every installed architecture: what its hook registered (what `oasr models` shows) is
    exactly its model class's ``capabilities``."""
    specs = list(get_registry("architecture"))
    assert {"whisper", "conformer", "example_energy"} <= {s.key for s in specs}
    for spec in specs:
        cls = spec.load()
        assert isinstance(spec.capabilities, ModelCapabilities), spec.key
        assert cls.capabilities == spec.capabilities, f"{spec.key}: {cls.capabilities} != {spec.capabilities}"


def test_first_party_catalogue_agrees_with_installed_plugins(fresh_plugins: None) -> None:
    registry = get_registry("architecture")
    for axis, known in KNOWN_PLUGINS.items():
        for key, entry in known.items():
            if key not in get_registry(axis):
                continue
            spec = get_registry(axis).get(key)
            assert spec.key == key, f"{key} is installed under another name: {spec.key}"
            assert spec.distribution == entry.distribution
            assert set(spec.aliases) == set(entry.aliases), key
    assert registry.get("conformer").aliases == ("wenet_conformer",)


# -- optional Protocols ---------------------------------------------------------------------------


class _Plain:
    """An ASRModel with no optional capability."""

    name = "plain"
    capabilities = ModelCapabilities(decode_family=DecodeFamily.CTC)
    feature_spec = FeatureSpec(kind="none")

    def transcribe(self, audios, options, progress=None):
        return [Transcript(text=f"{len(a)}", language=None, duration=len(a) / 16000) for a in audios]


class _WithExecutor(_Plain):
    def __init__(self, executor: object | None) -> None:
        self.executor = executor

    def make_executor(self, config):
        return self.executor


class _Holding:
    """An executor that holds requests without finishing them; may declare ``max_requests``."""

    def __init__(self) -> None:
        self.held: list = []

    @property
    def num_running(self) -> int:
        return len(self.held)

    def try_admit(self, request) -> bool:
        self.held.append(request)
        return True

    def step(self):
        return []

    def abort(self, request) -> bool:
        return False


class _HoldingMore(_Holding):
    max_requests = 3


def test_executor_for_uses_the_supports_executor_protocol() -> None:
    config = SchedulerConfig(max_batch_size=2)
    own = _Holding()
    assert isinstance(_WithExecutor(own), SupportsExecutor)
    assert executor_for(_WithExecutor(own), config) is own
    assert isinstance(executor_for(_WithExecutor(None), config), BatchExecutor)  # declined
    assert not isinstance(_Plain(), SupportsExecutor)
    assert isinstance(executor_for(_Plain(), config), BatchExecutor)


@pytest.mark.parametrize(("executor", "admitted"), [(_Holding(), 1), (_HoldingMore(), 3)])
def test_scheduler_admits_max_requests_of_an_executor_that_holds_extra(executor, admitted: int) -> None:
    assert isinstance(executor, HoldsExtraRequests) is (admitted == 3)
    scheduler = Scheduler(executor, SchedulerConfig(max_batch_size=1))
    for _ in range(4):
        scheduler.submit(np.zeros(1600, dtype=np.float32), DecodingOptions())
    scheduler.step()
    assert executor.num_running == admitted


def test_model_device_reads_the_has_device_protocol() -> None:
    class OnGpu(_Plain):
        device = "cuda:1"

    assert isinstance(OnGpu(), HasDevice) and model_device(OnGpu()) == "cuda:1"
    assert not isinstance(_Plain(), HasDevice) and model_device(_Plain()) == "cpu"


def test_first_party_models_satisfy_their_protocols() -> None:
    whisper = get_registry("architecture").resolve("whisper")
    conformer = get_registry("architecture").resolve("conformer")
    for cls in (whisper, conformer):
        assert isinstance(cls, SupportsNativeFormat), cls  # the class: from_native + save_native
    assert issubclass(whisper, SupportsExecutor)
    assert not isinstance(_Plain, SupportsNativeFormat)


# -- native checkpoints under an old key -----------------------------------------------------------


class _NativeToy(_Plain):
    """A toy architecture with the native format, registered as ``toy_native`` (alias
    ``toy_old``)."""

    seen_bodies: list[dict] = []

    @classmethod
    def from_native(cls, path, body, config):
        cls.seen_bodies.append(dict(body))
        return cls()

    def save_native(self, dst: Path) -> str:
        dst.mkdir(parents=True, exist_ok=True)
        (dst / NATIVE_CONFIG).write_text(json.dumps(
            {"format_version": NATIVE_FORMAT_VERSION, "architecture": "toy_native"}
        ))
        return "toy_native"


class _NativePlugin:
    @hookimpl
    def register_architectures(self, register):
        register("toy_native", "oasr_test_native_toy:NativeToy", aliases=["toy_old"],
                 capabilities=_NativeToy.capabilities)
        register("toy_plain", "oasr_test_native_toy:Plain", capabilities=_Plain.capabilities)


@pytest.fixture
def native_toy(monkeypatch: pytest.MonkeyPatch, fresh_plugins: None):
    module = types.ModuleType("oasr_test_native_toy")
    module.NativeToy = _NativeToy
    module.Plain = _Plain
    monkeypatch.setitem(sys.modules, "oasr_test_native_toy", module)
    _NativeToy.seen_bodies.clear()
    with temporary_plugin(_NativePlugin(), name="oasr-test-native"):
        yield


def _native_dir(root: Path, architecture: str) -> Path:
    root.mkdir()
    (root / NATIVE_CONFIG).write_text(json.dumps(
        {"format_version": NATIVE_FORMAT_VERSION, "architecture": architecture}
    ))
    return root


def test_native_checkpoint_naming_an_alias_loads(native_toy: None, tmp_path: Path) -> None:
    model = load_model(EngineConfig(ckpt_dir=str(_native_dir(tmp_path / "old", "toy_old"))))
    assert isinstance(model, _NativeToy)
    # the plugin sees the canonical key, whatever the checkpoint was written with
    assert _NativeToy.seen_bodies[-1]["architecture"] == "toy_native"
    assert convert_checkpoint(tmp_path / "old", tmp_path / "new") == "toy_native"


def test_native_checkpoint_of_an_architecture_without_the_format(native_toy: None, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="cannot read the native format"):
        load_model(EngineConfig(ckpt_dir=str(_native_dir(tmp_path / "plain", "toy_plain"))))


# -- documentation --------------------------------------------------------------------------------


def _doc() -> str:
    return PLUGINS_DOC.read_text()


def _hookspecs() -> list[tuple[str, str]]:
    out = []
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction):
        if hasattr(fn, "oasr_spec"):
            params = ", ".join(inspect.signature(fn).parameters)
            out.append((name, f"{name}({params})"))
    return out


def _metadata_keys_core_reads() -> set[str]:
    """Every ``metadata.get("key")`` / ``metadata["key"]`` in core, plus the registration
    keywords the registrar itself consumes."""
    pattern = re.compile(r"""metadata(?:\.get\(\s*|\[\s*)["'](\w+)["']""")
    keys: set[str] = set()
    for path in CORE_SRC.rglob("*.py"):
        keys.update(pattern.findall(path.read_text()))
    return keys | {"aliases", "capabilities"}


def test_every_hook_is_documented_with_its_signature() -> None:
    doc = _doc()
    specs = _hookspecs()
    assert len(specs) >= 8  # the scan found the hooks
    missing = [sig for _, sig in specs if f"`{sig}`" not in doc]
    assert not missing, f"docs/plugins.md lacks {missing}"
    assert "`register(key, target, *, aliases=(), **metadata)`" in doc


def test_every_metadata_key_core_reads_is_documented() -> None:
    doc = _doc()
    keys = _metadata_keys_core_reads()
    assert {"priority", "device_types", "source_formats", "description"} <= keys  # the scan works
    missing = sorted(k for k in keys if f"`{k}`" not in doc)
    assert not missing, f"docs/plugins.md does not document metadata keys {missing}"


def test_every_capability_and_protocol_is_documented() -> None:
    doc = _doc()
    missing = [f for f in CAPABILITY_FIELDS if f"`{f}`" not in doc]
    assert not missing, f"docs/plugins.md lacks capability fields {missing}"
    protocols = [
        name for name, obj in inspect.getmembers(model_contracts, inspect.isclass)
        if obj.__module__ == model_contracts.__name__ and getattr(obj, "_is_protocol", False)
    ]
    assert {"ASRModel", "SupportsNativeFormat", "SupportsExecutor", "HasDevice", "HoldsExtraRequests"} <= set(protocols)
    missing = [p for p in protocols if f"`{p}`" not in doc]
    assert not missing, f"docs/plugins.md lacks Protocols {missing}"


def test_every_alias_and_environment_variable_is_documented() -> None:
    doc = _doc()
    for known in KNOWN_PLUGINS["architecture"].values():
        for alias in known.aliases:
            assert f"`{alias}`" in doc, alias
    for key in KNOWN_PLUGINS["architecture"]:
        assert f"`{key}`" in doc, key
    for name in ("OASR_PLUGINS", "OASR_DISABLE_PLUGINS", "temporary_plugin", "register_plugin"):
        assert name in doc, name

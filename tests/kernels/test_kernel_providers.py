"""Kernel provider activation (oasr.kernel_providers) and the oasr-kernels plugin, on CPU."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import oasr.layers as L
from oasr import kernel_providers
from oasr.plugins import get_registry

# A provider for "cpu" so that activation and dispatch can be checked end to end without a GPU.
GOOD = {
    "oasr_fake_kernels": """
        from oasr import hookimpl

        CALLS = []

        @hookimpl
        def register_kernel_providers(register):
            register("fake-cpu", "oasr_fake_kernels:install", device_types=["cpu"])

        @hookimpl
        def register_checkpoint_formats(register):
            register("fake-kernels-ckpt", "oasr_fake_kernels:Format", priority=1000)

        def paged(q, k_pool, v_pool, block_tables, lengths, scale):
            return q * 0 + 42

        def install(device_type):
            import oasr.layers as L
            CALLS.append(device_type)
            L.register_override("paged_decode_attention", device_type, paged)

        class Format:
            @staticmethod
            def detect(path):
                return (path / "fake_kernels.json").is_file()

            @staticmethod
            def load(path, config):
                import oasr.layers as L
                # the provider is installed before the model is built
                return {"override_at_load": L.get_override("paged_decode_attention", "cpu")}
    """,
}
FAILING = {
    "oasr_failing_kernels": """
        from oasr import hookimpl

        @hookimpl
        def register_kernel_providers(register):
            register("failing-cpu", "oasr_failing_kernels:install", device_types=["cpu"])

        def install(device_type):
            import oasr.layers as L
            L.register_override("attention", device_type, lambda *a: None)
            raise RuntimeError("no such GPU architecture")
    """,
}
UNIMPORTABLE = {
    "oasr_unimportable_kernels": """
        from oasr import hookimpl

        @hookimpl
        def register_kernel_providers(register):
            register("cpu", "oasr_unimportable_kernels_impl:install")
    """,
}


def _inputs():
    q = torch.randn(2, 2, 1, 8)
    pool = torch.randn(4, 4, 2, 8)
    return q, pool, pool.clone(), torch.tensor([[1, 2], [3, 1]]), torch.tensor([3, 8])


def test_fake_provider_is_installed_once_and_dispatches(install_fake) -> None:
    install_fake("oasr-fake-kernels", "oasr_fake_kernels", GOOD)
    assert "oasr_fake_kernels" not in sys.modules or not sys.modules["oasr_fake_kernels"].CALLS
    assert kernel_providers.install_kernel_providers("cpu") == ["oasr-fake-kernels"]
    assert kernel_providers.install_kernel_providers("cpu:0") == ["oasr-fake-kernels"]
    assert sys.modules["oasr_fake_kernels"].CALLS == ["cpu"]  # once per process
    assert kernel_providers.install_kernel_providers("meta") == []  # no provider for it
    out = L.paged_decode_attention(*_inputs())
    assert torch.all(out == 42)
    with L.override("paged_decode_attention", "cpu", lambda *a: NotImplemented):
        pass  # the context manager puts the provider's override back
    assert torch.all(L.paged_decode_attention(*_inputs()) == 42)


def test_failing_provider_warns_rolls_back_and_others_still_install(install_fake, caplog) -> None:
    install_fake("oasr-fake-kernels", "oasr_fake_kernels", GOOD)
    install_fake("oasr-failing-kernels", "oasr_failing_kernels", FAILING)
    install_fake("oasr-unimportable-kernels", "oasr_unimportable_kernels", UNIMPORTABLE)
    attention_before = L.get_override("attention", "cpu")
    with caplog.at_level(logging.WARNING, logger="oasr.kernel_providers"):
        installed = kernel_providers.install_kernel_providers("cpu")
    assert installed == ["oasr-fake-kernels"]
    text = caplog.text
    assert "oasr-failing-kernels" in text and "no such GPU architecture" in text
    assert "oasr-unimportable-kernels" in text and "native oasr.layers ops" in text
    # the failing provider's half-done registration is undone; native attention still runs
    assert L.get_override("attention", "cpu") is attention_before
    q, kp, vp, tables, lengths = _inputs()
    assert L.attention(q, q, q).shape == q.shape


def test_disable_overrides_skips_providers(install_fake, monkeypatch) -> None:
    install_fake("oasr-fake-kernels", "oasr_fake_kernels", GOOD)
    monkeypatch.setenv("OASR_DISABLE_OVERRIDES", "1")
    assert kernel_providers.install_kernel_providers("cpu") == []
    assert L.get_override("paged_decode_attention", "cpu") is None


def test_load_model_installs_providers_for_its_device(install_fake, tmp_path: Path) -> None:
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    install_fake("oasr-fake-kernels", "oasr_fake_kernels", GOOD)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "fake_kernels.json").write_text(json.dumps({}))
    model = load_model(EngineConfig(ckpt_dir=str(ckpt), device="cpu"))
    assert model["override_at_load"] is sys.modules["oasr_fake_kernels"].paged


def test_oasr_kernels_registers_a_lazy_cuda_provider(clean_providers) -> None:
    (spec,) = [s for s in get_registry("kernel_provider") if s.distribution == "oasr-kernels"]
    assert spec.key == "cuda" and spec.target == "oasr_kernels.provider:install"
    assert spec.metadata["device_types"] == ["cuda"]
    assert "paged_decode_attention" in spec.metadata["ops"]
    assert [s.key for s in kernel_providers.kernel_providers_for("cuda")] == ["cuda"]
    assert kernel_providers.kernel_providers_for("cpu") == []


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_oasr_kernels_without_cupy_warns_and_keeps_native_ops(clean_providers, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="oasr.kernel_providers"):
        assert kernel_providers.install_kernel_providers("cuda") == []
    assert "oasr-kernels" in caplog.text and "oasr-kernels[cuda12]" in caplog.text
    assert L.get_override("paged_decode_attention", "cuda") is None


def test_cuda_override_declines_cpu_tensors() -> None:
    from oasr_kernels.paged_attention import paged_decode_attention_cuda, unsupported_reason

    args = _inputs()
    assert unsupported_reason(*args) == "not a CUDA tensor"
    assert paged_decode_attention_cuda(*args) is NotImplemented


def test_imports_stay_light() -> None:
    code = (
        "import sys, oasr, oasr.kernel_providers, oasr_kernels, oasr_kernels.plugin, "
        "oasr_kernels.provider; from oasr.plugins import get_registry; "
        "get_registry('kernel_provider'); "
        "print(sorted(m for m in ('torch', 'cupy', 'numpy') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

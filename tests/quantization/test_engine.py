"""Quantization through the public surfaces: EngineConfig, load_model, the CLI's
--quantization / --compute-type int8, and the typed errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from oasr.errors import UnsupportedOptionError
from oasr.types import EngineConfig

sys.path.insert(0, str(Path(__file__).parent))


def test_engine_config_names():
    assert EngineConfig(quantization="int8_w8a8").quantization == "int8_w8a8"
    assert EngineConfig(quantization="INT8").quantization == "int8_w8a8"
    assert EngineConfig(quantization="fp8").quantization == "fp8_w8a8"
    assert EngineConfig(quantization="none").quantization is None
    assert EngineConfig(kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert EngineConfig(kv_cache_dtype="auto").kv_cache_dtype is None
    with pytest.raises(UnsupportedOptionError, match="int4.*int8_w8a8, fp8_w8a8") as info:
        EngineConfig(quantization="int4")
    assert info.value.param == "quantization"
    with pytest.raises(UnsupportedOptionError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


def test_compute_types_map_onto_int8():
    from oasr.cli.transcribe import UsageError, check_compute

    assert check_compute("int8", None) == ("auto", "int8_w8a8")
    assert check_compute("int8_float32", None) == ("float32", "int8_w8a8")
    assert check_compute("int8_float16", None) == ("float16", "int8_w8a8")
    assert check_compute("int8_bfloat16", None) == ("bfloat16", "int8_w8a8")
    assert check_compute("float16", "fp8_w8a8") == ("float16", "fp8_w8a8")
    assert check_compute("default", None) == ("auto", None)
    with pytest.raises(UsageError, match="contradicts"):
        check_compute("int8", "fp8_w8a8")
    with pytest.raises(UsageError, match="int16"):
        check_compute("int16", None)
    with pytest.raises(UsageError, match="--quantization int4"):
        check_compute("auto", "int4")


def test_load_model_quantizes_and_keeps_the_family_list():
    """A WeNet checkpoint loaded with quantization: every linear but the family's kept ones is
    quantized, and the model still recognises (same API, finite output)."""
    import numpy as np
    from qhelpers import REPO

    from oasr.checkpoint import load_model
    from oasr.layers import Linear
    from oasr.layers.quantized import QuantizedLinear
    from oasr.types import DecodingOptions

    model = load_model(EngineConfig(ckpt_dir=str(REPO / "tests/data/wenet/u2pp_conformer"),
                                    quantization="int8_w8a8"))  # fmt: skip
    report = model.quantization
    assert report.method == "int8_w8a8" and len(report.quantized) > 30
    net = model.net
    kept = {n for n, m in net.named_modules() if type(m) is Linear}
    assert {f"net.{n}" for n in kept} == set(report.kept)
    assert all(isinstance(net.get_submodule(n[len("net."):]), QuantizedLinear) for n in report.quantized)
    wave = np.random.default_rng(0).standard_normal(16000).astype(np.float32) * 0.1
    (t,) = model.transcribe([wave], DecodingOptions())
    assert isinstance(t.text, str)


def test_quantize_model_refuses_a_model_without_networks():
    from oasr.quantization import quantize_model

    class NoNet:
        name = "toy"

    with pytest.raises(UnsupportedOptionError, match="no torch network"):
        quantize_model(NoNet(), "int8_w8a8")


def test_fp8_refused_on_a_gpu_without_fp8(monkeypatch):
    import torch

    from oasr.quantization.apply import check_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda dev=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda dev=None: "NVIDIA A100")
    with pytest.raises(UnsupportedOptionError, match=r"compute capability >= 8.9.*A100 is 8.0"):
        check_device("fp8_w8a8", "cuda:0")
    check_device("int8_w8a8", "cuda:0")  # int8 has no such requirement
    with pytest.raises(UnsupportedOptionError, match="mps"):
        check_device("int8_w8a8", "mps")


def test_server_cli_takes_quantization_flags():
    pytest.importorskip("oasr_server")
    from typer.testing import CliRunner

    from oasr_server.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert "--quantization" in r.stdout and "--kv-cache-dtype" in r.stdout
    r = runner.invoke(app, ["--quantization", "int4"])
    assert r.exit_code != 0 and "quantization 'int4' is not supported" in r.stderr

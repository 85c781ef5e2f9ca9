"""The quantized native checkpoint (format version 2) and ``oasr quantize``: SmoothQuant
calibration on real audio, write, load with no flag, identical outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import REPO  # noqa: E402

WENET = REPO / "tests" / "data" / "wenet" / "u2pp_conformer"
SPEECH = REPO / "tests" / "data" / "speech"


@pytest.fixture()
def manifest(tmp_path: Path) -> Path:
    """Two short clips, one with a path relative to the manifest, one absolute."""
    (tmp_path / "audio").mkdir()
    clip = tmp_path / "audio" / "one.wav"
    clip.write_bytes((SPEECH / "en_sr_one_two_three.wav").read_bytes())
    path = tmp_path / "calib.jsonl"
    rows = [{"audio": "audio/one.wav", "duration_s": 2.5},
            {"audio_filepath": str(SPEECH / "zh_aishell_BAC009S0764W0121.wav")}]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _load(path: Path, **kw):
    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    return load_model(EngineConfig(ckpt_dir=str(path), **kw))


def _outputs(model):
    from oasr.audio import load_audio
    from oasr.types import DecodingOptions

    net = model.net
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(2, 90, net.encoder.global_cmvn.mean.shape[0], generator=g)
    with torch.no_grad():
        enc, _ = net.encoder(feats, torch.tensor([90, 71]))
        logp = net.ctc_log_probs(enc)
    wave = load_audio(SPEECH / "zh_aishell_BAC009S0764W0121.wav", 16000)
    (t,) = model.transcribe([np.asarray(wave)], DecodingOptions())
    return logp, t.text


@pytest.mark.parametrize("recipe", ["smoothquant_w8a8", "fp8"])
def test_quantize_save_load_gives_identical_outputs(tmp_path, manifest, recipe):
    from oasr.layers.quantized import QuantizedLinear
    from oasr.quantization.recipes import quantize_checkpoint

    model = _load(WENET)
    dst = tmp_path / "q"
    summary = quantize_checkpoint(WENET, dst, recipe, calib_manifest=manifest, model=model)
    assert "linear layers quantized" in summary
    body = json.loads((dst / "oasr_model.json").read_text())
    block = body["quantization"]
    assert body["format_version"] == 2 and block["recipe"] == recipe
    assert set(block["kept"]) == {"net.encoder.embed.out", "net.ctc_lo", "net.decoder.output_layer",
                                  "net.r_decoder.output_layer"}  # fmt: skip
    if recipe == "smoothquant_w8a8":
        assert block["alpha"] == 0.5 and block["calibration"]["files"] == 2
        # CTC decoding never runs the attention decoders: those layers are listed, unsmoothed
        assert block["unsmoothed"] and all("decoder." in n for n in block["unsmoothed"])
        smoothed = [m for m in model.net.modules() if isinstance(m, QuantizedLinear) and m.input_scale is not None]
        assert len(smoothed) == len(block["layers"]) - len(block["unsmoothed"])
    loaded = _load(dst)  # no flag: the checkpoint says how it is quantized
    assert loaded.quantization.method == block["method"]
    for name, m in model.net.named_modules():
        if isinstance(m, QuantizedLinear):
            other = loaded.net.get_submodule(name)
            assert torch.equal(m.qweight, other.qweight) and torch.equal(m.weight_scale, other.weight_scale)
            assert (m.input_scale is None) == (other.input_scale is None)
    got, want = _outputs(loaded), _outputs(model)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    # asking for the checkpoint's own method is fine, another one is refused
    _load(dst, quantization=block["method"])
    from oasr.errors import UnsupportedOptionError

    other = "fp8_w8a8" if block["method"] == "int8_w8a8" else "int8_w8a8"
    with pytest.raises(UnsupportedOptionError, match=f"quantized with {block['method']}"):
        _load(dst, quantization=other)


def test_smoothing_moves_range_into_the_weights(manifest):
    """SmoothQuant's divisor: alpha 1 makes every calibrated channel's activation maximum 1;
    alpha 0 leaves activations alone and divides by the weight maxima."""
    from oasr.quantization.apply import quantizable_linears
    from oasr.quantization.smoothquant import calibrate, read_manifest, smoothing_scales

    model = _load(WENET)
    targets = quantizable_linears(model)
    calib = calibrate(model, read_manifest(manifest), targets)
    name = "net.encoder.encoders.0.feed_forward.w_1"
    a = calib.act_max[name]
    s1 = smoothing_scales(calib, {name: targets[name]}, 1.0)[name]
    live = a > 1e-5
    assert torch.allclose((a / s1)[live], torch.ones_like(a)[live], rtol=1e-5)
    s0 = smoothing_scales(calib, {name: targets[name]}, 0.0)[name]
    w = targets[name].weight.abs().amax(dim=0)
    assert torch.allclose(s0 * w, torch.ones_like(w), rtol=1e-5)


def test_manifest_errors(tmp_path):
    from oasr.errors import InvalidRequestError
    from oasr.quantization.smoothquant import read_manifest

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no audio"}\n')
    with pytest.raises(InvalidRequestError, match=r"bad.jsonl:1: not a JSON object with an 'audio'"):
        read_manifest(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"audio": "nowhere.wav"}\n')
    with pytest.raises(InvalidRequestError, match="nowhere.wav does not exist"):
        read_manifest(missing)
    with pytest.raises(InvalidRequestError, match="calib-manifest"):
        read_manifest(tmp_path / "absent.jsonl")


def test_cli_help_lists_recipes_and_refuses_bad_input(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from oasr.cli.main import app

    monkeypatch.setenv("COLUMNS", "100")
    runner = CliRunner()
    r = runner.invoke(app, ["quantize", "--help"])
    assert r.exit_code == 0
    for name in ("smoothquant_w8a8", "smoothquant_fp8", "w8a8", "fp8", "--calib-manifest", "--alpha"):
        assert name in r.stdout
    r = runner.invoke(app, ["quantize", str(WENET), str(tmp_path / "o"), "--recipe", "int4"])
    assert r.exit_code == 2 and "--recipe int4" in r.stderr
    r = runner.invoke(app, ["quantize", str(WENET), str(tmp_path / "o")])
    assert r.exit_code == 2 and "needs --calib-manifest" in r.stderr
    assert not (tmp_path / "o").exists()

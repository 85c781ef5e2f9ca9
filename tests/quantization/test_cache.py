"""The quantized-weight disk cache (``oasr.quantization.cache``) and the background packing of
CPU int8 weights: a cached load gives the same tensors and outputs bit for bit, its key follows
the checkpoint's files and the options, damaged or foreign entries are misses, and the packed
weights made on the thread are the ones the forward pass would make."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import whisper_logits, whisper_net  # noqa: E402

from oasr.layers import quantized  # noqa: E402
from oasr.layers.int8_avx2 import fbgemm_int8_applies  # noqa: E402
from oasr.layers.quantized import QuantizedLinear  # noqa: E402
from oasr.quantization import cache  # noqa: E402
from oasr.quantization.apply import PREPACK_ENV, TIED_ENV, networks, quantize_model  # noqa: E402


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):
    """A checkpoint directory (its files only key the cache) and a private cache directory."""
    monkeypatch.setenv(cache.DIR_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(cache.CACHE_ENV, raising=False)
    monkeypatch.delenv(TIED_ENV, raising=False)
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "model.bin").write_bytes(b"weights v1")
    return src


def _model():
    return SimpleNamespace(name="whisper-test", network=whisper_net(seed=5))


def _state(model) -> dict[str, torch.Tensor]:
    return dict(networks(model)["network"].state_dict())


def _entries(tmp: Path) -> list[Path]:
    return sorted((tmp / "cache").glob("*.safetensors"))


def test_cached_load_is_bit_identical(ckpt):
    first, second = _model(), _model()
    r1 = quantize_model(first, "int8_w8a8", source=ckpt)
    r2 = quantize_model(second, "int8_w8a8", source=ckpt)
    assert not r1.cached and r2.cached
    assert "network.decoder.output_projection" in r2.quantized  # the tied table came from the cache too
    assert len(_entries(ckpt.parent)) == 1
    s1, s2 = _state(first), _state(second)
    assert s1.keys() == s2.keys()
    for k in s1:
        assert s1[k].dtype == s2[k].dtype and torch.equal(s1[k], s2[k]), k
    torch.manual_seed(0)
    mel, tokens = torch.randn(1, 80, 3000), torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert torch.equal(whisper_logits(first.network, mel, tokens), whisper_logits(second.network, mel, tokens))


def test_key_follows_files_and_options(ckpt, monkeypatch):
    quantize_model(_model(), "int8_w8a8", source=ckpt)
    # another method, or the tied projection kept float: a different entry, not this one
    assert not quantize_model(_model(), "fp8_w8a8", source=ckpt).cached
    monkeypatch.setenv(TIED_ENV, "0")
    assert not quantize_model(_model(), "int8_w8a8", source=ckpt).cached
    monkeypatch.delenv(TIED_ENV)
    assert quantize_model(_model(), "int8_w8a8", source=ckpt).cached
    # the checkpoint rewritten (size and time change): a miss, and the stale entry is replaced
    before = _entries(ckpt.parent)
    (ckpt / "model.bin").write_bytes(b"weights v2, longer")
    os.utime(ckpt / "model.bin", ns=(1, 1))
    assert not quantize_model(_model(), "int8_w8a8", source=ckpt).cached
    after = _entries(ckpt.parent)
    assert len(after) == len(before) and set(after) != set(before)
    # another network shape (a different layer plan): a miss
    other = SimpleNamespace(name="whisper-test", network=whisper_net(seed=5, d=32))
    assert not quantize_model(other, "int8_w8a8", source=ckpt).cached


def test_damaged_or_foreign_entry_is_a_miss(ckpt):
    quantize_model(_model(), "int8_w8a8", source=ckpt)
    (entry,) = _entries(ckpt.parent)
    entry.write_bytes(entry.read_bytes()[:1000])  # truncated
    model = _model()
    assert not quantize_model(model, "int8_w8a8", source=ckpt).cached
    assert quantize_model(_model(), "int8_w8a8", source=ckpt).cached  # rewritten whole
    # an entry written for another key under this name is not adopted
    path, key = entry, {"not": "this"}
    cache.store(path, key, {"x": (torch.zeros(2, 2, dtype=torch.int8), torch.ones(2))})
    assert not quantize_model(_model(), "int8_w8a8", source=ckpt).cached


def test_switched_off_and_unwritable(ckpt, monkeypatch, tmp_path):
    monkeypatch.setenv(cache.CACHE_ENV, "0")
    assert not quantize_model(_model(), "int8_w8a8", source=ckpt).cached
    assert _entries(ckpt.parent) == []
    monkeypatch.delenv(cache.CACHE_ENV)
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.DIR_ENV, str(blocker / "sub"))  # a directory that cannot be made
    model = _model()
    report = quantize_model(model, "int8_w8a8", source=ckpt)
    assert not report.cached and len(report.quantized) > 0


def test_background_packing_matches_inline(ckpt, monkeypatch):
    model = _model()
    report = quantize_model(model, "int8_w8a8")
    if report.prepack is None:
        assert not quantized._onednn_int8_works()  # no thread only where oneDNN is not the GEMM
        pytest.skip("oneDNN's int8 linear is not used on this machine")
    report.prepack.join(30)
    layers = [m for m in model.network.modules() if isinstance(m, QuantizedLinear)]
    # every layer packed where the thread's one-time check found oneDNN's int8 linear exact
    # (the forward pass then uses it), none where it did not (the forward pass never packs)
    assert all((m._onednn is not None) == quantized._ONEDNN_INT8[0] for m in layers)
    monkeypatch.setenv(PREPACK_ENV, "0")
    inline = _model()
    assert quantize_model(inline, "int8_w8a8").prepack is None
    torch.manual_seed(1)
    mel, tokens = torch.randn(1, 80, 3000), torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        assert torch.equal(whisper_logits(model.network, mel, tokens), whisper_logits(inline.network, mel, tokens))


def test_no_onednn_packing_without_int8_dot_product(ckpt, monkeypatch):
    """On an x86 CPU without VNNI / AMX (an AVX2 EPYC) oneDNN's int8 linear saturates: nothing
    packs for it (the thread packs only FBGEMM's form of the two-term layers: the tied
    projection), the forward pass never packs for it, and its outputs are the reference's."""
    monkeypatch.setattr(quantized, "_ONEDNN_INT8", [])
    monkeypatch.setattr(quantized, "_NO_INT8_DOT", [True])
    model = _model()
    report = quantize_model(model, "int8_w8a8")
    two_term = [m for m in model.network.modules() if isinstance(m, QuantizedLinear) and m.act_terms == 2]
    assert two_term and report.prepack is not None
    report.prepack.join(30)
    assert all((getattr(m, "_fbgemm_packed", None) is not None) == fbgemm_int8_applies() for m in two_term)
    assert quantized._ONEDNN_INT8 == []  # the thread never asked for oneDNN's int8 linear
    torch.manual_seed(2)
    mel, tokens = torch.randn(1, 80, 3000), torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        got = whisper_logits(model.network, mel, tokens)
        want = whisper_logits(model.network.double(), mel.double(), tokens)
    assert quantized._ONEDNN_INT8 == [False]
    layers = [m for m in model.network.modules() if isinstance(m, QuantizedLinear)]
    assert layers and all(m._onednn is None for m in layers)
    assert float((got.double() - want).abs().max()) <= 1e-2 * float(want.abs().max())


@pytest.mark.parametrize(
    ("machine", "flags", "no_dot"),
    [
        ("x86_64", {"avx2": True}, True),
        ("x86_64", {"avx2": True, "avx_vnni": True}, False),
        ("AMD64", {"avx512_vnni": True}, False),
        ("x86_64", {"amx_int8": True}, False),
        ("aarch64", {}, False),
    ],
)
def test_int8_dot_product_flags(monkeypatch, machine, flags, no_dot):
    import platform

    monkeypatch.setattr(quantized, "_NO_INT8_DOT", [])
    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags, raising=False)
    assert quantized._x86_without_int8_dot() is no_dot


def test_exit_while_packing_is_clean(tmp_path):
    """A process that quantizes and exits at once (the packing thread still running) exits with
    0: the thread stops after its layer at exit instead of being torn down inside oneDNN."""
    here = Path(__file__).parent
    code = (
        f"import sys; sys.path.insert(0, {str(here)!r})\n"
        "from types import SimpleNamespace\n"
        "from qhelpers import whisper_net\n"
        "from oasr.quantization.apply import quantize_model\n"
        "r = quantize_model(SimpleNamespace(name='t', network=whisper_net(seed=1, vocab=4096)), 'int8_w8a8')\n"
        "print('started', r.prepack is not None)\n"
    )
    env = {**os.environ, cache.DIR_ENV: str(tmp_path)}
    env.pop(PREPACK_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "terminate called" not in out.stderr

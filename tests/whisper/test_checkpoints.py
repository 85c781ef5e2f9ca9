"""Checkpoint loaders: the real tiny.en CTranslate2 model against ctranslate2/faster-whisper
(test-only references), HF/openai/native layouts, format detection and error messages."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from oasr.errors import CheckpointError
from oasr_models_whisper import ct2 as ct2_reader
from oasr_models_whisper.checkpoints import (
    decode_openai_alignment_heads,
    expected_shapes,
    load_any,
    load_ct2,
    load_hf,
    load_native,
    load_openai,
    save_native,
)
from oasr_models_whisper.formats import CT2WhisperFormat, HFWhisperFormat, OpenAIWhisperFormat
from oasr_models_whisper.nn import build_network

EOT, SOT, NO_TIMESTAMPS = 50256, 50257, 50362  # English-only vocabulary


@pytest.fixture(scope="module")
def ct2_loaded(ct2_tiny_en_dir):
    return load_ct2(ct2_tiny_en_dir)


@pytest.fixture(scope="module")
def ct2_raw(ct2_tiny_en_dir):
    return ct2_reader.read_model_bin(ct2_tiny_en_dir / "model.bin")


@pytest.fixture(scope="module")
def ct2_net(ct2_loaded):
    return build_network(ct2_loaded)


@pytest.fixture(scope="module")
def ct2_features(ct2_net, jfk_mel):
    return ct2_net.encode(jfk_mel[None])


def test_checkpoint_ct2_every_variable_has_the_right_shape(ct2_raw, ct2_loaded):
    raw = ct2_raw
    assert raw.spec_name == "WhisperSpec" and raw.binary_version >= 5
    assert raw.aliases == {"decoder/projection/weight": "decoder/embeddings/weight"}
    d = ct2_loaded.dims
    assert (d.n_mels, d.n_audio_state, d.n_audio_head, d.n_audio_layer) == (80, 384, 6, 4)
    assert (d.n_vocab, d.n_text_ctx, d.n_text_head, d.n_text_layer) == (51864, 448, 6, 4)
    shapes = expected_shapes(d)
    assert set(ct2_loaded.state_dict) == set(shapes)
    for name, shape in shapes.items():
        t = ct2_loaded.state_dict[name]
        assert tuple(t.shape) == shape, name
        assert t.dtype == torch.float16, name  # stored dtype preserved
    assert all(bool(torch.isfinite(t).all()) for t in ct2_loaded.state_dict.values())
    # every weight variable of model.bin was used (scalars/config flags aside)
    weights = {k for k, v in raw.variables.items() if v.ndim > 0 and k not in raw.aliases}
    assert len(weights) == 11 + 12 * d.n_audio_layer + 20 * d.n_text_layer
    assert ct2_loaded.size_name == "tiny.en"
    assert not ct2_loaded.is_multilingual and ct2_loaded.num_languages == 0
    assert ct2_loaded.alignment_heads.tolist()[:3] == [[1, 0], [2, 0], [2, 5]]
    assert ct2_loaded.suppress_tokens[:3] == (1, 2, 7)
    assert ct2_loaded.begin_suppress_tokens == (220, 50256)
    assert set(ct2_loaded.tokenizer_files) >= {"tokenizer.json", "vocabulary.txt"}


def test_checkpoint_ct2_encoder_matches_ctranslate2(ct2_tiny_en_dir, ct2_features, jfk_mel):
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = ctranslate2.models.Whisper(str(ct2_tiny_en_dir), device="cpu", compute_type="float32")
    ref = model.encode(ctranslate2.StorageView.from_array(np.ascontiguousarray(jfk_mel[None].numpy())), to_cpu=True)
    ref = torch.from_numpy(np.array(ref))
    err = float((ct2_features - ref).abs().max())
    print(f"ct2 tiny.en encoder max abs err {err:.2e} (|ref| max {float(ref.abs().max()):.1f})")
    assert ct2_features.shape == (1, 1500, 384)
    assert err < 1e-3


def _greedy(net, features, prompt, steps, suppress=(), begin_suppress=()):
    cache = net.new_cache(features)
    tokens = torch.tensor([prompt])
    out: list[int] = []
    logits = net.decode(tokens, cache)[:, -1]
    for i in range(steps):
        if suppress:
            logits[:, list(suppress)] = -np.inf
        if i == 0 and begin_suppress:
            logits[:, list(begin_suppress)] = -np.inf
        nxt = int(logits.argmax(-1))
        out.append(nxt)
        if nxt == EOT:
            break
        logits = net.decode(torch.tensor([[nxt]]), cache)[:, -1]
    return out


def test_checkpoint_ct2_greedy_matches_ctranslate2_generate(ct2_tiny_en_dir, ct2_net, ct2_features, jfk_mel):
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = ctranslate2.models.Whisper(str(ct2_tiny_en_dir), device="cpu", compute_type="float32")
    prompt = [SOT, NO_TIMESTAMPS]
    res = model.generate(
        ctranslate2.StorageView.from_array(np.ascontiguousarray(jfk_mel[None].numpy())),
        [prompt],
        beam_size=1,
        max_length=len(prompt) + 14,
        suppress_blank=False,
        suppress_tokens=[],
        return_logits_vocab=True,
    )
    ref = [t for t in res[0].sequences_ids[0] if t != EOT][:12]
    ours = _greedy(ct2_net, ct2_features, prompt, len(ref))
    print(f"greedy tokens ours {ours} ctranslate2 {ref}")
    assert len(ref) >= 6
    assert ours == ref
    # per-step logits of the generated tokens, teacher-forced through our decoder
    ref_logits = torch.from_numpy(np.stack([np.array(x) for x in res[0].logits[0]]))
    ref_logits = ref_logits.reshape(ref_logits.shape[0], -1)
    cache = ct2_net.new_cache(ct2_features)
    logits = ct2_net.decode(torch.tensor([prompt + ref]), cache)[0, len(prompt) - 1 :]
    err = float((logits[: len(ref_logits)] - ref_logits).abs().max())
    print(f"ct2 tiny.en decoder logits max abs err {err:.2e} (|ref| max {float(ref_logits.abs().max()):.1f})")
    assert err < 1e-3


def test_checkpoint_ct2_greedy_matches_faster_whisper(ct2_tiny_en_dir, ct2_net, ct2_loaded, jfk_audio):
    fw = pytest.importorskip("faster_whisper")
    model = fw.WhisperModel(str(ct2_tiny_en_dir), device="cpu", compute_type="float32", cpu_threads=2)
    segments, _ = model.transcribe(
        jfk_audio, beam_size=1, temperature=0.0, without_timestamps=True, language="en",
        condition_on_previous_text=False,
    )
    first = next(iter(segments))
    ref = [t for t in first.tokens if t < EOT][:10]
    # faster-whisper's own features, so only the network differs
    feats = model.feature_extractor(jfk_audio)[:, :3000]
    mel = torch.from_numpy(np.ascontiguousarray(feats, dtype=np.float32))
    if mel.shape[-1] < 3000:
        mel = torch.nn.functional.pad(mel, (0, 3000 - mel.shape[-1]))
    features = ct2_net.encode(mel[None])
    ours = _greedy(
        ct2_net, features, [SOT, NO_TIMESTAMPS], len(ref),
        suppress=ct2_loaded.suppress_tokens, begin_suppress=ct2_loaded.begin_suppress_tokens,
    )
    print(f"faster-whisper tokens {ref} ours {ours} ({first.text!r})")
    assert ours == ref


def test_checkpoint_native_round_trip_is_bitwise(tmp_path, ct2_loaded, hf_tiny_dir):
    for name, loaded in [("ct2", ct2_loaded), ("hf", load_hf(hf_tiny_dir))]:
        dst = tmp_path / name
        assert save_native(dst, loaded) == "whisper"
        body = json.loads((dst / "oasr_model.json").read_text())
        assert body["architecture"] == "whisper" and body["format_version"] == 1
        back = load_native(dst)
        assert back.dims == loaded.dims
        assert set(back.state_dict) == set(loaded.state_dict)
        for key, t in loaded.state_dict.items():
            u = back.state_dict[key]
            assert u.dtype == t.dtype and torch.equal(u.view(torch.uint8), t.contiguous().view(torch.uint8)), key
        assert torch.equal(back.alignment_heads, loaded.alignment_heads)
        for attr in ("is_multilingual", "num_languages", "suppress_tokens", "begin_suppress_tokens",
                     "lang_ids", "lang_to_id", "generation_config"):
            assert getattr(back, attr) == getattr(loaded, attr), attr
        assert set(back.tokenizer_files) == set(loaded.tokenizer_files)
        for fname, p in back.tokenizer_files.items():
            assert p.parent == dst and p.read_bytes() == loaded.tokenizer_files[fname].read_bytes()
        assert back.source_format == "oasr"
        assert load_any(dst).dims == loaded.dims


def test_checkpoint_hf_metadata(hf_tiny_dir):
    loaded = load_hf(hf_tiny_dir)
    assert loaded.source_format == "hf"
    assert loaded.is_multilingual and loaded.num_languages == 99
    assert loaded.alignment_heads.tolist() == [[1, 0], [1, 3], [0, 2]]
    assert "vocab.json" in loaded.tokenizer_files
    assert all(not k.startswith("proj_out") for k in loaded.state_dict)


def test_checkpoint_hf_default_alignment_heads(tmp_path, hf_tiny_dir):
    import shutil

    dst = tmp_path / "hf"
    shutil.copytree(hf_tiny_dir, dst)
    (dst / "generation_config.json").unlink()
    loaded = load_hf(dst)
    assert loaded.alignment_heads.tolist() == [[1, h] for h in range(4)]
    assert loaded.suppress_tokens is None or isinstance(loaded.suppress_tokens, tuple)


def test_checkpoint_openai_alignment_heads_decoding():
    import base64
    import gzip

    from oasr_models_whisper.network import WhisperDims

    dims = WhisperDims(80, 1500, 64, 4, 2, 51864, 448, 64, 4, 3)
    mask = np.zeros((3, 4), dtype=bool)
    mask[2, 1] = mask[1, 3] = True
    heads = decode_openai_alignment_heads(base64.b85encode(gzip.compress(mask.tobytes())), dims)
    assert heads.tolist() == [[1, 3], [2, 1]]
    with pytest.raises(CheckpointError, match="alignment heads"):
        decode_openai_alignment_heads(base64.b85encode(gzip.compress(b"\x00" * 5)), dims)


def test_checkpoint_openai_real_table_by_file_name(tmp_path, openai_tiny):
    whisper = pytest.importorskip("whisper")
    _, path = openai_tiny
    loaded = load_openai(path)  # unknown name -> default heads
    assert loaded.alignment_heads.tolist() == [[1, h] for h in range(4)]
    assert loaded.source_format == "openai-whisper" and not loaded.is_multilingual
    # a file named like a released model picks openai-whisper's table (here: mask sizes differ
    # from the tiny random dims, so expect a clear error rather than silent garbage)
    named = tmp_path / "tiny.en.pt"
    named.write_bytes(path.read_bytes())
    assert "tiny.en" in whisper._ALIGNMENT_HEADS
    with pytest.raises(CheckpointError, match="alignment heads mask"):
        load_openai(named)


def test_checkpoint_formats_detect(tmp_path, hf_tiny_dir, ct2_tiny_en_dir, openai_tiny):
    _, pt = openai_tiny
    assert HFWhisperFormat.detect(hf_tiny_dir)
    assert not HFWhisperFormat.detect(ct2_tiny_en_dir)
    assert CT2WhisperFormat.detect(ct2_tiny_en_dir)
    assert not CT2WhisperFormat.detect(hf_tiny_dir)
    assert OpenAIWhisperFormat.detect(pt) and OpenAIWhisperFormat.detect(pt.parent)
    assert not OpenAIWhisperFormat.detect(hf_tiny_dir)
    # a torch file that is not an openai-whisper checkpoint
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(2)}, other)
    assert not OpenAIWhisperFormat.detect(other)
    # a CTranslate2 model of another spec
    bad = tmp_path / "ct2"
    bad.mkdir()
    name = b"TransformerSpec\0"
    (bad / "model.bin").write_bytes(struct.pack("<IH", 6, len(name)) + name + struct.pack("<I", 1))
    assert not CT2WhisperFormat.detect(bad)
    assert not HFWhisperFormat.detect(tmp_path / "missing")


def test_checkpoint_detect_does_not_import_torch(hf_tiny_dir, ct2_tiny_en_dir):
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path\n"
        "from oasr_models_whisper.formats import HFWhisperFormat, CT2WhisperFormat, OpenAIWhisperFormat\n"
        f"assert HFWhisperFormat.detect(Path({str(hf_tiny_dir)!r}))\n"
        f"assert CT2WhisperFormat.detect(Path({str(ct2_tiny_en_dir)!r}))\n"
        f"OpenAIWhisperFormat.detect(Path({str(hf_tiny_dir)!r}))\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_checkpoint_ct2_dequantizes_int8(tmp_path, ct2_tiny_en_dir, ct2_raw):
    """Rewrite one weight as int8 + per-row scale, as ct2's int8 quantization does."""
    raw = ct2_raw
    name = "decoder/layer_0/ffn/linear_0/weight"
    w = raw.variables[name].astype(np.float32)
    scale = (127.0 / np.abs(w).max(axis=1)).astype(np.float32)
    q = np.rint(w * scale[:, None]).astype(np.int8)
    dst = tmp_path / "int8"
    dst.mkdir()
    _write_model_bin(dst / "model.bin", raw, {name: (q, 1), name + "_scale": (scale, 0)})
    (dst / "config.json").write_bytes((ct2_tiny_en_dir / "config.json").read_bytes())
    loaded = load_ct2(dst)
    got = loaded.state_dict["decoder.layers.0.mlp.fc1.weight"]
    assert got.dtype == torch.float32
    assert float((got - torch.from_numpy(w)).abs().max()) <= float((1 / scale).max()) / 2 + 1e-6


def test_checkpoint_ct2_refuses_unknown_version(tmp_path):
    name = b"WhisperSpec\0"
    d = tmp_path / "old"
    d.mkdir()
    (d / "model.bin").write_bytes(struct.pack("<IH", 2, len(name)) + name + struct.pack("<II", 1, 0))
    with pytest.raises(CheckpointError, match="binary version 2"):
        load_ct2(d)
    (d / "model.bin").write_bytes(struct.pack("<IH", 6, len(name)) + name + struct.pack("<II", 3, 5))
    with pytest.raises(CheckpointError, match="truncated"):
        load_ct2(d)


def test_checkpoint_load_errors(tmp_path, hf_tiny_dir):
    import shutil

    dst = tmp_path / "hf"
    shutil.copytree(hf_tiny_dir, dst)
    (dst / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf(dst)
    with pytest.raises(CheckpointError):
        load_any(tmp_path)


def _write_model_bin(path: Path, raw, replace: dict[str, tuple[np.ndarray, int]]) -> None:
    """Serialize variables the way model.bin stores them (test helper; version 6)."""
    type_ids = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4, "bfloat16": 5}

    def s(text: str) -> bytes:
        b = text.encode() + b"\0"
        return struct.pack("<H", len(b)) + b

    items = {k: (v, type_ids[raw.dtypes[k]]) for k, v in raw.variables.items() if k not in raw.aliases}
    items.update(replace)
    out = [struct.pack("<I", 6), s(raw.spec_name), struct.pack("<II", raw.spec_revision, len(items))]
    for k, (arr, tid) in sorted(items.items()):
        data = np.ascontiguousarray(arr).tobytes()
        out.append(s(k) + struct.pack("<B", arr.ndim) + struct.pack(f"<{arr.ndim}I", *arr.shape))
        out.append(struct.pack("<BI", tid, len(data)) + data)
    out.append(struct.pack("<I", len(raw.aliases)))
    for a, t in raw.aliases.items():
        out.append(s(a) + s(t))
    path.write_bytes(b"".join(out))


def test_checkpoint_detect_load_convert_through_core(tmp_path, ct2_tiny_en_dir):
    """Core's detection picks CT2WhisperFormat, builds WhisperASR; `convert` writes the native
    format, which core detects and loads back with identical weights."""
    pytest.importorskip("oasr_models_whisper.model")
    from oasr.checkpoint import convert_checkpoint, detect_format, load_model
    from oasr.types import EngineConfig

    assert detect_format(ct2_tiny_en_dir) == "whisper-ctranslate2"
    model = load_model(EngineConfig(ckpt_dir=str(ct2_tiny_en_dir)))
    assert "tiny.en" in model.name
    dst = tmp_path / "native"
    assert convert_checkpoint(ct2_tiny_en_dir, dst) == "whisper"
    assert detect_format(dst) == "oasr"
    back = load_model(EngineConfig(ckpt_dir=str(dst)))
    a = dict(model.network.named_parameters())
    b = dict(back.network.named_parameters())
    assert a and a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_checkpoint_hf_bin_and_sharded_layouts(tmp_path, hf_tiny_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    ref = load_hf(hf_tiny_dir).state_dict
    tensors = load_file(str(hf_tiny_dir / "model.safetensors"))
    names = sorted(tensors)
    # pytorch_model.bin
    a = tmp_path / "bin"
    shutil.copytree(hf_tiny_dir, a)
    (a / "model.safetensors").unlink()
    torch.save(tensors, a / "pytorch_model.bin")
    # two safetensors shards + index
    b = tmp_path / "sharded"
    shutil.copytree(hf_tiny_dir, b)
    (b / "model.safetensors").unlink()
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(b / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (b / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for d in (a, b):
        assert HFWhisperFormat.detect(d)
        got = load_hf(d).state_dict
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)

"""Whisper checkpoint loaders: every layout becomes one :class:`LoadedWhisper`.

Public API (used by ``model.py`` / ``formats.py``)::

    LoadedWhisper(dims, state_dict, alignment_heads, tokenizer_files, is_multilingual,
                  num_languages, suppress_tokens=None, begin_suppress_tokens=None,
                  lang_ids=None, lang_to_id=None, generation_config={}, source_format="",
                  source_path=None)
    load_hf(path) -> LoadedWhisper                  # config.json + model.safetensors / .bin
    load_ct2(path) -> LoadedWhisper                 # CTranslate2 / faster-whisper model.bin
    load_openai(path, alignment_heads=None) -> LoadedWhisper   # openai-whisper .pt
    load_native(path, body=None) -> LoadedWhisper   # oasr_model.json + model.safetensors
    save_native(dst, loaded) -> str                 # returns the architecture key "whisper"
    load_any(path) -> LoadedWhisper                 # detect the layout, then one of the above

``state_dict`` uses the naming documented in :mod:`oasr_models_whisper.nn`; tensors keep the
stored float dtype (fp32/fp16/bf16; int8 CTranslate2 weights are dequantized to fp32).
``tokenizer_files`` maps a file name ("tokenizer.json", "vocab.json", "merges.txt",
"vocabulary.txt", ...) to its path in the checkpoint; empty for openai-whisper ``.pt`` files
(the tokenizer then comes from the vocabulary size: multilingual or GPT-2).
"""

from __future__ import annotations

import base64
import gzip
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oasr.errors import CheckpointError
from oasr_models_whisper.network import WhisperDims

ARCHITECTURE = "whisper"
WEIGHTS_FILE = "model.safetensors"

#: Files copied next to native checkpoints and exposed in ``tokenizer_files`` when present.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "special_tokens_map.json",
    "normalizer.json",
    "vocabulary.txt",
    "vocabulary.json",
    "preprocessor_config.json",
)


@dataclass
class LoadedWhisper:
    """A Whisper checkpoint in OASR's normalized form, independent of its source layout."""

    dims: WhisperDims
    #: OASR naming (see ``nn.py``); float tensors in the stored dtype, on CPU
    state_dict: dict[str, torch.Tensor]
    #: (N, 2) long tensor of (decoder layer, head)
    alignment_heads: torch.Tensor
    #: file name -> path of tokenizer assets inside the checkpoint
    tokenizer_files: dict[str, Path]
    is_multilingual: bool
    num_languages: int
    #: tokens suppressed at every step (HF ``suppress_tokens`` / CT2 ``suppress_ids``)
    suppress_tokens: tuple[int, ...] | None = None
    #: tokens suppressed at the first sampled position (``begin_suppress_tokens``)
    begin_suppress_tokens: tuple[int, ...] | None = None
    #: language token ids in order (CT2 ``lang_ids``, or the values of ``lang_to_id``)
    lang_ids: tuple[int, ...] | None = None
    #: "<|en|>" -> id, when the checkpoint says (HF generation_config.json)
    lang_to_id: dict[str, int] | None = None
    #: the rest of the source's generation defaults (HF generation_config.json), JSON-able
    generation_config: dict[str, Any] = field(default_factory=dict)
    #: "hf" | "ctranslate2" | "openai-whisper" | "oasr"
    source_format: str = ""
    source_path: Path | None = None

    @property
    def size_name(self) -> str:
        """Best guess of the released size ("tiny.en", "large-v3", "turbo", ...) from dims."""
        return guess_size_name(self.dims)


def multilingual_from_vocab(n_vocab: int) -> tuple[bool, int]:
    """(is_multilingual, num_languages) as openai-whisper derives them from the vocabulary."""
    multilingual = n_vocab >= 51865
    return multilingual, (n_vocab - 51765 - int(multilingual)) if multilingual else 0


def guess_size_name(dims: WhisperDims) -> str:
    names = {384: "tiny", 512: "base", 768: "small", 1024: "medium", 1280: "large"}
    name = names.get(dims.n_audio_state, f"d{dims.n_audio_state}")
    distilled = dims.n_text_layer < dims.n_audio_layer
    if name == "large":
        v3 = dims.n_mels == 128
        if dims.n_text_layer == 4:
            name = "turbo"
        elif distilled:
            name = "distil-large-v3" if v3 else "distil-large-v2"
        elif v3:
            name = "large-v3"
    elif distilled:
        name = f"distil-{name}"
    if not multilingual_from_vocab(dims.n_vocab)[0]:
        name += ".en"
    return name


def _heads_tensor(heads: Any) -> torch.Tensor:
    return torch.as_tensor(np.asarray(heads, dtype=np.int64).reshape(-1, 2), dtype=torch.long)


def decode_openai_alignment_heads(encoded: str | bytes, dims: WhisperDims) -> torch.Tensor:
    """openai-whisper's base85 + gzip boolean mask (n_text_layer, n_text_head) -> (N, 2) pairs."""
    raw = gzip.decompress(base64.b85decode(encoded))
    mask = np.frombuffer(raw, dtype=bool).copy()
    if mask.size != dims.n_text_layer * dims.n_text_head:
        raise CheckpointError(
            f"alignment heads mask has {mask.size} entries; the model has "
            f"{dims.n_text_layer} x {dims.n_text_head} decoder heads"
        )
    return torch.from_numpy(np.argwhere(mask.reshape(dims.n_text_layer, dims.n_text_head)))


def _default_heads(dims: WhisperDims) -> torch.Tensor:
    from oasr_models_whisper.nn import default_alignment_heads

    return default_alignment_heads(dims)


def _tokenizer_files(path: Path) -> dict[str, Path]:
    return {name: path / name for name in TOKENIZER_FILE_NAMES if (path / name).is_file()}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is unreadable: {exc}") from exc


def _tuple_or_none(value: Any) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(v) for v in value)


def _check_complete(state: dict[str, torch.Tensor], dims: WhisperDims, where: Path) -> None:
    expected = expected_shapes(dims)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"{where}: whisper checkpoint is missing {len(missing)} tensors, e.g. {missing[:5]}"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{where}: {name} has shape {tuple(state[name].shape)}, expected {shape}"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise CheckpointError(f"{where}: unexpected tensors {extra[:5]}")


def expected_shapes(dims: WhisperDims) -> dict[str, tuple[int, ...]]:
    """Every tensor of the normalized state dict with its shape."""
    shapes: dict[str, tuple[int, ...]] = {}
    d, m = dims.n_audio_state, dims.n_mels
    shapes["encoder.conv1.weight"] = (d, m, 3)
    shapes["encoder.conv1.bias"] = (d,)
    shapes["encoder.conv2.weight"] = (d, d, 3)
    shapes["encoder.conv2.bias"] = (d,)
    shapes["encoder.positional_embedding"] = (dims.n_audio_ctx, d)

    def block(prefix: str, d: int, cross: bool) -> None:
        attns = ["self_attn"] + (["cross_attn"] if cross else [])
        for a in attns:
            for p in ("q_proj", "k_proj", "v_proj", "out_proj"):
                shapes[f"{prefix}.{a}.{p}.weight"] = (d, d)
                if p != "k_proj":
                    shapes[f"{prefix}.{a}.{p}.bias"] = (d,)
            shapes[f"{prefix}.{a}_norm.weight"] = (d,)
            shapes[f"{prefix}.{a}_norm.bias"] = (d,)
        shapes[f"{prefix}.mlp.fc1.weight"] = (4 * d, d)
        shapes[f"{prefix}.mlp.fc1.bias"] = (4 * d,)
        shapes[f"{prefix}.mlp.fc2.weight"] = (d, 4 * d)
        shapes[f"{prefix}.mlp.fc2.bias"] = (d,)
        shapes[f"{prefix}.mlp_norm.weight"] = (d,)
        shapes[f"{prefix}.mlp_norm.bias"] = (d,)

    for i in range(dims.n_audio_layer):
        block(f"encoder.layers.{i}", d, cross=False)
    shapes["encoder.final_norm.weight"] = (d,)
    shapes["encoder.final_norm.bias"] = (d,)
    t = dims.n_text_state
    shapes["decoder.embed_tokens.weight"] = (dims.n_vocab, t)
    shapes["decoder.positional_embedding"] = (dims.n_text_ctx, t)
    for i in range(dims.n_text_layer):
        block(f"decoder.layers.{i}", t, cross=True)
    shapes["decoder.final_norm.weight"] = (t,)
    shapes["decoder.final_norm.bias"] = (t,)
    return shapes


# -- Hugging Face ---------------------------------------------------------------------------------

_HF_BLOCK = {
    "self_attn_layer_norm": "self_attn_norm",
    "encoder_attn_layer_norm": "cross_attn_norm",
    "encoder_attn": "cross_attn",
    "self_attn": "self_attn",
    "final_layer_norm": "mlp_norm",
    "fc1": "mlp.fc1",
    "fc2": "mlp.fc2",
}


def _hf_name(name: str) -> str | None:
    """HF Whisper tensor name -> OASR name (None: drop it)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("proj_out."):
        return None  # tied to decoder.embed_tokens
    side, _, rest = name.partition(".")
    if side not in ("encoder", "decoder"):
        return None
    if rest == "embed_positions.weight":
        return f"{side}.positional_embedding"
    if rest.startswith("layer_norm."):
        return f"{side}.final_norm.{rest.split('.', 1)[1]}"
    if rest.startswith(("conv1.", "conv2.", "embed_tokens.")):
        return f"{side}.{rest}"
    if rest.startswith("layers."):
        _, idx, sub = rest.split(".", 2)
        module, _, tail = sub.partition(".")
        if module in _HF_BLOCK:
            return f"{side}.layers.{idx}.{_HF_BLOCK[module]}.{tail}"
    raise CheckpointError(f"unknown tensor {name!r} in Hugging Face Whisper checkpoint")


def _hf_load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        return load_file(str(path / "model.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        out: dict[str, torch.Tensor] = {}
        for shard in shards:
            out.update(load_file(str(path / shard)))
        return out
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    bin_index = path / "pytorch_model.bin.index.json"
    if bin_index.is_file():
        out = {}
        for shard in sorted(set(_read_json(bin_index)["weight_map"].values())):
            out.update(torch.load(path / shard, map_location="cpu", weights_only=True))
        return out
    raise CheckpointError(
        f"{path} has a Whisper config.json but no model.safetensors or pytorch_model.bin"
    )


def load_hf(path: str | Path) -> LoadedWhisper:
    """A Hugging Face ``transformers`` Whisper directory (WhisperForConditionalGeneration or
    WhisperModel weights; distil-whisper included)."""
    path = Path(path)
    cfg = _read_json(path / "config.json")
    if cfg.get("model_type") != "whisper":
        raise CheckpointError(f"{path}/config.json is not a Whisper config (model_type {cfg.get('model_type')!r})")
    dims = WhisperDims(
        n_mels=int(cfg["num_mel_bins"]),
        n_audio_ctx=int(cfg["max_source_positions"]),
        n_audio_state=int(cfg["d_model"]),
        n_audio_head=int(cfg["encoder_attention_heads"]),
        n_audio_layer=int(cfg["encoder_layers"]),
        n_vocab=int(cfg["vocab_size"]),
        n_text_ctx=int(cfg["max_target_positions"]),
        n_text_state=int(cfg["d_model"]),
        n_text_head=int(cfg["decoder_attention_heads"]),
        n_text_layer=int(cfg["decoder_layers"]),
    )
    for key in ("encoder_ffn_dim", "decoder_ffn_dim"):
        if key in cfg and int(cfg[key]) != 4 * dims.n_audio_state:
            raise CheckpointError(
                f"{path}: {key}={cfg[key]} but Whisper's MLP is 4 x d_model ({4 * dims.n_audio_state})"
            )
    state: dict[str, torch.Tensor] = {}
    for name, tensor in _hf_load_tensors(path).items():
        new = _hf_name(name)
        if new is not None:
            state[new] = tensor.contiguous()
    _check_complete(state, dims, path)
    gen = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    heads = gen.get("alignment_heads")
    multilingual, n_lang = multilingual_from_vocab(dims.n_vocab)
    if "is_multilingual" in gen:
        multilingual = bool(gen["is_multilingual"])
    lang_to_id = gen.get("lang_to_id") or None
    if lang_to_id:
        n_lang = len(lang_to_id)
    suppress = gen.get("suppress_tokens", cfg.get("suppress_tokens"))
    begin = gen.get("begin_suppress_tokens", cfg.get("begin_suppress_tokens"))
    extra = {
        k: v
        for k, v in gen.items()
        if k not in ("alignment_heads", "suppress_tokens", "begin_suppress_tokens", "lang_to_id")
    }
    return LoadedWhisper(
        dims=dims,
        state_dict=state,
        alignment_heads=_heads_tensor(heads) if heads else _default_heads(dims),
        tokenizer_files=_tokenizer_files(path),
        is_multilingual=multilingual,
        num_languages=n_lang,
        suppress_tokens=_tuple_or_none(suppress),
        begin_suppress_tokens=_tuple_or_none(begin),
        lang_ids=tuple(sorted(int(v) for v in lang_to_id.values())) if lang_to_id else None,
        lang_to_id={str(k): int(v) for k, v in lang_to_id.items()} if lang_to_id else None,
        generation_config=extra,
        source_format="hf",
        source_path=path,
    )


# -- CTranslate2 ----------------------------------------------------------------------------------


def _ct2_state(model: Any, path: Path) -> tuple[WhisperDims, dict[str, torch.Tensor]]:
    from oasr_models_whisper.ct2 import to_float32

    v = model.variables

    def get(name: str) -> torch.Tensor:
        if name not in v:
            raise CheckpointError(f"{path}: model.bin lacks variable {name!r}")
        dtype = model.dtypes[name]
        scale_name = name + "_scale"
        if dtype in ("float32", "float16"):
            arr = v[name]
        elif dtype == "bfloat16":
            return torch.from_numpy(v[name].view(np.int16).copy()).view(torch.bfloat16)
        elif dtype in ("int8", "int16") and scale_name in v:
            arr = to_float32(v[name], dtype, to_float32(v[scale_name], model.dtypes[scale_name], None))
        else:
            raise CheckpointError(
                f"{path}: variable {name!r} is {dtype} without a scale; this loader handles "
                f"float32/float16/bfloat16 and int8/int16 with weight_scale"
            )
        return torch.from_numpy(np.ascontiguousarray(arr))

    def count(prefix: str) -> int:
        n = 0
        while f"{prefix}/layer_{n}/ffn/linear_0/weight" in v:
            n += 1
        return n

    conv1 = v["encoder/conv1/weight"]
    emb = v["decoder/embeddings/weight"]
    dims = WhisperDims(
        n_mels=int(conv1.shape[1]),
        n_audio_ctx=int(v["encoder/position_encodings/encodings"].shape[0]),
        n_audio_state=int(conv1.shape[0]),
        n_audio_head=int(v["encoder/num_heads"]),
        n_audio_layer=count("encoder"),
        n_vocab=int(emb.shape[0]),
        n_text_ctx=int(v["decoder/position_encodings/encodings"].shape[0]),
        n_text_state=int(emb.shape[1]),
        n_text_head=int(v["decoder/num_heads"]),
        n_text_layer=count("decoder"),
    )
    s: dict[str, torch.Tensor] = {}
    for conv in ("conv1", "conv2"):
        s[f"encoder.{conv}.weight"] = get(f"encoder/{conv}/weight")
        s[f"encoder.{conv}.bias"] = get(f"encoder/{conv}/bias")
    s["encoder.positional_embedding"] = get("encoder/position_encodings/encodings")
    s["decoder.positional_embedding"] = get("decoder/position_encodings/encodings")
    s["decoder.embed_tokens.weight"] = get("decoder/embeddings/weight")
    for side in ("encoder", "decoder"):
        s[f"{side}.final_norm.weight"] = get(f"{side}/layer_norm/gamma")
        s[f"{side}.final_norm.bias"] = get(f"{side}/layer_norm/beta")

    def norm(dst: str, src: str) -> None:
        s[f"{dst}.weight"] = get(f"{src}/gamma")
        s[f"{dst}.bias"] = get(f"{src}/beta")

    def lin(dst: str, src: str) -> None:
        s[f"{dst}.weight"] = get(f"{src}/weight")
        s[f"{dst}.bias"] = get(f"{src}/bias")

    def split_rows(t: torch.Tensor, parts: int) -> list[torch.Tensor]:
        return [c.contiguous() for c in torch.chunk(t, parts, dim=0)]

    n_layers = {"encoder": dims.n_audio_layer, "decoder": dims.n_text_layer}
    for side, n in n_layers.items():
        for i in range(n):
            src, dst = f"{side}/layer_{i}", f"{side}.layers.{i}"
            # Self-attention: linear_0 is the fused [q; k; v] projection (the key bias rows are
            # zeros and dropped), linear_1 the output projection.
            qkv_w = split_rows(get(f"{src}/self_attention/linear_0/weight"), 3)
            qkv_b = split_rows(get(f"{src}/self_attention/linear_0/bias"), 3)
            for j, p in enumerate(("q_proj", "k_proj", "v_proj")):
                s[f"{dst}.self_attn.{p}.weight"] = qkv_w[j]
                if p != "k_proj":
                    s[f"{dst}.self_attn.{p}.bias"] = qkv_b[j]
            lin(f"{dst}.self_attn.out_proj", f"{src}/self_attention/linear_1")
            norm(f"{dst}.self_attn_norm", f"{src}/self_attention/layer_norm")
            if side == "decoder":
                # Cross-attention: linear_0 query, linear_1 fused [k; v], linear_2 output.
                lin(f"{dst}.cross_attn.q_proj", f"{src}/attention/linear_0")
                kv_w = split_rows(get(f"{src}/attention/linear_1/weight"), 2)
                kv_b = split_rows(get(f"{src}/attention/linear_1/bias"), 2)
                s[f"{dst}.cross_attn.k_proj.weight"] = kv_w[0]
                s[f"{dst}.cross_attn.v_proj.weight"] = kv_w[1]
                s[f"{dst}.cross_attn.v_proj.bias"] = kv_b[1]
                lin(f"{dst}.cross_attn.out_proj", f"{src}/attention/linear_2")
                norm(f"{dst}.cross_attn_norm", f"{src}/attention/layer_norm")
            lin(f"{dst}.mlp.fc1", f"{src}/ffn/linear_0")
            lin(f"{dst}.mlp.fc2", f"{src}/ffn/linear_1")
            norm(f"{dst}.mlp_norm", f"{src}/ffn/layer_norm")
    return dims, s


def load_ct2(path: str | Path) -> LoadedWhisper:
    """A CTranslate2 Whisper directory (faster-whisper): ``model.bin`` + ``config.json`` +
    ``tokenizer.json`` / ``vocabulary.*``. float16/bfloat16 weights keep their dtype; int8/int16
    weights are dequantized to float32 with their ``weight_scale``."""
    from oasr_models_whisper.ct2 import read_model_bin

    path = Path(path)
    model = read_model_bin(path / "model.bin")
    if model.spec_name != "WhisperSpec":
        raise CheckpointError(f"{path}/model.bin is a CTranslate2 {model.spec_name}, not WhisperSpec")
    dims, state = _ct2_state(model, path)
    _check_complete(state, dims, path)
    cfg = _read_json(path / "config.json") if (path / "config.json").is_file() else {}
    heads = cfg.get("alignment_heads")
    multilingual, n_lang = multilingual_from_vocab(dims.n_vocab)
    lang_ids = _tuple_or_none(cfg.get("lang_ids"))
    return LoadedWhisper(
        dims=dims,
        state_dict=state,
        alignment_heads=_heads_tensor(heads) if heads else _default_heads(dims),
        tokenizer_files=_tokenizer_files(path),
        is_multilingual=multilingual,
        num_languages=n_lang,
        suppress_tokens=_tuple_or_none(cfg.get("suppress_ids")),
        begin_suppress_tokens=_tuple_or_none(cfg.get("suppress_ids_begin")),
        lang_ids=lang_ids,
        lang_to_id=None,
        generation_config={},
        source_format="ctranslate2",
        source_path=path,
    )


# -- openai-whisper .pt ---------------------------------------------------------------------------

_OPENAI_BLOCK = {
    "attn": "self_attn",
    "attn_ln": "self_attn_norm",
    "cross_attn": "cross_attn",
    "cross_attn_ln": "cross_attn_norm",
    "mlp_ln": "mlp_norm",
}
_OPENAI_ATTN = {"query": "q_proj", "key": "k_proj", "value": "v_proj", "out": "out_proj"}


def _openai_name(name: str) -> str | None:
    side, _, rest = name.partition(".")
    if side not in ("encoder", "decoder"):
        raise CheckpointError(f"unknown tensor {name!r} in openai-whisper checkpoint")
    if rest in ("positional_embedding", "mask"):
        return None if rest == "mask" else f"{side}.positional_embedding"
    if rest.startswith(("ln_post.", "ln.")):
        return f"{side}.final_norm.{rest.split('.', 1)[1]}"
    if rest.startswith("token_embedding."):
        return f"{side}.embed_tokens.{rest.split('.', 1)[1]}"
    if rest.startswith(("conv1.", "conv2.")):
        return f"{side}.{rest}"
    if rest.startswith("blocks."):
        _, idx, module, tail = rest.split(".", 3)
        if module == "mlp":
            n, param = tail.split(".")
            return f"{side}.layers.{idx}.mlp.{ {'0': 'fc1', '2': 'fc2'}[n] }.{param}"
        if module in ("attn", "cross_attn"):
            lin, param = tail.split(".")
            return f"{side}.layers.{idx}.{_OPENAI_BLOCK[module]}.{_OPENAI_ATTN[lin]}.{param}"
        if module in _OPENAI_BLOCK:
            return f"{side}.layers.{idx}.{_OPENAI_BLOCK[module]}.{tail}"
    raise CheckpointError(f"unknown tensor {name!r} in openai-whisper checkpoint")


def _find_pt(path: Path) -> Path:
    if path.is_file():
        return path
    pts = sorted(p for p in path.glob("*.pt") if p.is_file())
    if len(pts) != 1:
        raise CheckpointError(f"{path}: expected exactly one openai-whisper .pt file, found {len(pts)}")
    return pts[0]


def load_openai(path: str | Path, alignment_heads: str | bytes | Any | None = None) -> LoadedWhisper:
    """An openai-whisper checkpoint (``{"dims": ..., "model_state_dict": ...}``), the file or a
    directory holding exactly one ``.pt``. ``alignment_heads``: openai's base85/gzip mask string
    or (layer, head) pairs; else an ``"alignment_heads"`` entry in the checkpoint; else, when the
    ``whisper`` package is importable and the file is named like a released model
    (``tiny.en.pt``), its table; else the default (last half of the decoder layers)."""
    file = _find_pt(Path(path))
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - surface what torch said
        raise CheckpointError(f"cannot load {file} as an openai-whisper checkpoint: {exc}") from exc
    if not isinstance(ckpt, dict) or "dims" not in ckpt or "model_state_dict" not in ckpt:
        raise CheckpointError(f"{file} is not an openai-whisper checkpoint (needs dims + model_state_dict)")
    raw = ckpt["dims"]
    dims = WhisperDims(**{f: int(raw[f]) for f in WhisperDims.__dataclass_fields__})
    state: dict[str, torch.Tensor] = {}
    for name, tensor in ckpt["model_state_dict"].items():
        new = _openai_name(name)
        if new is not None:
            state[new] = tensor.contiguous()
    _check_complete(state, dims, file)
    given = alignment_heads if alignment_heads is not None else ckpt.get("alignment_heads")
    if given is None:
        given = _openai_known_heads(file)
    if given is None:
        heads = _default_heads(dims)
    elif isinstance(given, (str, bytes)):
        heads = decode_openai_alignment_heads(given, dims)
    elif isinstance(given, torch.Tensor) and given.dtype == torch.bool:
        heads = torch.nonzero(given.reshape(dims.n_text_layer, dims.n_text_head))
    else:
        heads = _heads_tensor(given)
    multilingual, n_lang = multilingual_from_vocab(dims.n_vocab)
    return LoadedWhisper(
        dims=dims,
        state_dict=state,
        alignment_heads=heads.long(),
        tokenizer_files=_tokenizer_files(file.parent) if Path(path).is_dir() else {},
        is_multilingual=multilingual,
        num_languages=n_lang,
        source_format="openai-whisper",
        source_path=file,
    )


def _openai_known_heads(file: Path) -> str | None:
    try:
        import whisper  # optional: openai-whisper's table of released models' heads
    except ImportError:
        return None
    table = getattr(whisper, "_ALIGNMENT_HEADS", {})
    return table.get(file.name[: -len(file.suffix)]) if file.suffix else None


# -- native ---------------------------------------------------------------------------------------


def save_native(dst: str | Path, loaded: LoadedWhisper) -> str:
    """Write ``model.safetensors`` + ``oasr_model.json`` + tokenizer assets to ``dst``.
    Weights are stored bit-for-bit as loaded. Returns ``"whisper"``."""
    from safetensors.torch import save_file

    from oasr.checkpoint import write_native_config

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in loaded.state_dict.items()}
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt", "architecture": ARCHITECTURE})
    copied: list[str] = []
    for name, src in sorted(loaded.tokenizer_files.items()):
        target = dst / name
        if Path(src).resolve() != target.resolve():
            shutil.copyfile(src, target)
        copied.append(name)
    write_native_config(
        dst,
        ARCHITECTURE,
        {
            "dims": {f: getattr(loaded.dims, f) for f in WhisperDims.__dataclass_fields__},
            "weights": WEIGHTS_FILE,
            "alignment_heads": loaded.alignment_heads.tolist(),
            "tokenizer_files": copied,
            "is_multilingual": loaded.is_multilingual,
            "num_languages": loaded.num_languages,
            "suppress_tokens": list(loaded.suppress_tokens) if loaded.suppress_tokens is not None else None,
            "begin_suppress_tokens": (
                list(loaded.begin_suppress_tokens) if loaded.begin_suppress_tokens is not None else None
            ),
            "lang_ids": list(loaded.lang_ids) if loaded.lang_ids is not None else None,
            "lang_to_id": loaded.lang_to_id,
            "generation_config": loaded.generation_config,
            "source_format": loaded.source_format,
            "feature_spec": {"kind": "whisper_logmel", "num_bins": loaded.dims.n_mels},
            "tokenizer": {"kind": "whisper_bpe"},
        },
    )
    return ARCHITECTURE


def load_native(path: str | Path, body: dict[str, Any] | None = None) -> LoadedWhisper:
    """Read what :func:`save_native` wrote. ``body``: the already-parsed ``oasr_model.json``."""
    from safetensors.torch import load_file

    from oasr.checkpoint import read_native_config

    path = Path(path)
    body = body if body is not None else read_native_config(path)
    if body.get("architecture") != ARCHITECTURE:
        raise CheckpointError(f"{path} holds a {body.get('architecture')!r} model, not whisper")
    try:
        dims = WhisperDims(**{f: int(body["dims"][f]) for f in WhisperDims.__dataclass_fields__})
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}/oasr_model.json has no complete 'dims': {exc}") from exc
    weights = path / body.get("weights", WEIGHTS_FILE)
    if not weights.is_file():
        raise CheckpointError(f"{weights} is missing")
    state = load_file(str(weights))
    _check_complete(state, dims, path)
    files = {name: path / name for name in body.get("tokenizer_files", []) if (path / name).is_file()}
    lang_to_id = body.get("lang_to_id")
    return LoadedWhisper(
        dims=dims,
        state_dict=state,
        alignment_heads=_heads_tensor(body.get("alignment_heads") or []),
        tokenizer_files=files,
        is_multilingual=bool(body.get("is_multilingual", multilingual_from_vocab(dims.n_vocab)[0])),
        num_languages=int(body.get("num_languages", multilingual_from_vocab(dims.n_vocab)[1])),
        suppress_tokens=_tuple_or_none(body.get("suppress_tokens")),
        begin_suppress_tokens=_tuple_or_none(body.get("begin_suppress_tokens")),
        lang_ids=_tuple_or_none(body.get("lang_ids")),
        lang_to_id={str(k): int(v) for k, v in lang_to_id.items()} if lang_to_id else None,
        generation_config=dict(body.get("generation_config") or {}),
        source_format="oasr",
        source_path=path,
    )


def load_any(path: str | Path) -> LoadedWhisper:
    """Detect the layout of ``path`` (native, CTranslate2, HF, openai-whisper) and load it."""
    from oasr_models_whisper import formats

    path = Path(path)
    if formats.is_native_whisper(path):
        return load_native(path)
    if formats.CT2WhisperFormat.detect(path):
        return load_ct2(path)
    if formats.HFWhisperFormat.detect(path):
        return load_hf(path)
    if formats.OpenAIWhisperFormat.detect(path):
        return load_openai(path)
    raise CheckpointError(f"{path} is not a Whisper checkpoint this plugin can read")

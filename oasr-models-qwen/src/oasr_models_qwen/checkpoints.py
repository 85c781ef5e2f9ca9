"""Reading a Hugging Face Qwen2-Audio directory: config, weights (one safetensors file or shards
with their index), tokenizer files, preprocessor and generation configs, the chat template.

Weight names are normalised from every layout ``transformers`` has written
(``model.audio_tower.*`` / ``model.language_model.*`` / ``lm_head.*`` in recent v5 releases;
``audio_tower.*`` / ``language_model.model.*`` / ``language_model.lm_head.*`` in v4 and the Hub
releases; ``language_model.model.model.*`` from early v5 such as 5.17, whose save_pretrained
renames the inner model twice) to the network's (``audio_tower.*``, ``projector.*``,
``decoder.*``, ``lm_head.*``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError
from oasr_models_qwen.config import QwenAudioConfig, parse_config

__all__ = ["LoadedQwenAudio", "load_hf", "load_native", "normalize_name", "save_native"]

#: the native format's weights file (the network's own names: fused q/k/v and gate/up)
WEIGHTS = "model.safetensors"

TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "chat_template.json",
                   "chat_template.jinja")  # fmt: skip

_PREFIXES = (
    ("model.audio_tower.", "audio_tower."),
    ("audio_tower.", "audio_tower."),
    ("model.multi_modal_projector.linear.", "projector."),
    ("multi_modal_projector.linear.", "projector."),
    ("model.language_model.", "decoder."),
    ("language_model.model.model.", "decoder."),  # longest first: transformers 5.17's save
    ("language_model.model.", "decoder."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)


@dataclass
class LoadedQwenAudio:
    path: Path
    config: QwenAudioConfig
    weights: dict[str, Any]  # normalised name -> CPU tensor
    tokenizer_files: dict[str, Path] = field(default_factory=dict)
    chat_template: str | None = None
    generation: dict[str, Any] = field(default_factory=dict)
    preprocessor: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        t = self.config.text
        return f"qwen2-audio ({t.layers} layers, d={t.hidden})"


def normalize_name(name: str) -> str | None:
    """The network's name for checkpoint tensor ``name`` (None: not a weight the network has)."""
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    if not isinstance(body, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return body


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        if not shards:
            raise CheckpointError(f"{index} has an empty weight_map")
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise CheckpointError(f"{path} is missing weight shard {missing[0]} named in {index.name}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")


def _chat_template(path: Path) -> str | None:
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    for name in ("chat_template.json", "tokenizer_config.json"):
        if (path / name).is_file():
            tpl = _read_json(path / name).get("chat_template")
            if isinstance(tpl, str):
                return tpl
    return None


def load_hf(path: Path) -> LoadedQwenAudio:
    """Read a ``save_pretrained`` directory of ``Qwen2AudioForConditionalGeneration``."""
    from safetensors.torch import load_file

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} has no config.json")
    config = parse_config(_read_json(path / "config.json"))
    weights: dict[str, Any] = {}
    for file in _weight_files(path):
        for name, tensor in load_file(str(file)).items():
            key = normalize_name(name)
            if key is not None:
                weights[key] = tensor
    files = {n: path / n for n in TOKENIZER_FILES if (path / n).is_file()}
    if "tokenizer.json" not in files and not {"vocab.json", "merges.txt"} <= files.keys():
        raise CheckpointError(f"{path} has no tokenizer.json (or vocab.json + merges.txt)")
    generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").is_file() else {}
    pre = path / "preprocessor_config.json"
    preprocessor = _read_json(pre) if pre.is_file() else {}
    return LoadedQwenAudio(path, config, weights, files, _chat_template(path), generation, preprocessor)


# -- OASR's native format (``oasr convert``) ---------------------------------------------------------


def save_native(dst: Path, model: Any) -> str:
    """Write ``model`` (a :class:`~oasr_models_qwen.model.Qwen2AudioASR`) as OASR's native format:
    the network's weights under its own names, ``tokenizer.json``, and ``oasr_model.json`` with
    the dimensions, the chat template, the stop tokens and the decoding defaults."""
    import dataclasses

    from safetensors.torch import save_file

    from oasr.checkpoint import write_native_config
    from oasr_models_qwen.plugin import ARCHITECTURE

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.network.state_dict().items()
             if not k.endswith("inv_freq")}  # fmt: skip
    save_file(state, str(dst / WEIGHTS))
    model.tokenizer.tok.save(str(dst / "tokenizer.json"))
    write_native_config(dst, ARCHITECTURE, {
        "qwen_config": dataclasses.asdict(model.network.config),
        "name": model.name,
        "chat_template": model.chat_template,
        "stop_tokens": list(model.stop_tokens),
        "context": model.context,
    }, feature_spec=model.feature_spec, decoding=model.default_options)  # fmt: skip
    return ARCHITECTURE


def load_native(path: Path, body: dict[str, Any]) -> LoadedQwenAudio:
    """The :class:`LoadedQwenAudio` of a native checkpoint written by :func:`save_native`."""
    from safetensors.torch import load_file

    from oasr_models_qwen.config import AudioDims, TextDims

    path = Path(path)
    try:
        cfg = body["qwen_config"]
        config = QwenAudioConfig(AudioDims(**cfg["audio"]), TextDims(**cfg["text"]),
                                 int(cfg["audio_token_id"]), tuple(cfg.get("eos_token_ids", ())))  # fmt: skip
        stops = [int(t) for t in body["stop_tokens"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: incomplete oasr_model.json ({exc})") from exc
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json")
    try:
        weights = load_file(str(path / WEIGHTS))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise CheckpointError(f"cannot read {path / WEIGHTS}: {exc}") from exc
    return LoadedQwenAudio(path, config, weights, {"tokenizer.json": path / "tokenizer.json"},
                           body.get("chat_template"), {"eos_token_id": stops})  # fmt: skip

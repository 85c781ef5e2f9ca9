"""Reading FastConformer checkpoints: the Hugging Face layout, ``.nemo`` archives and OASR's
native format. Each returns ``(NemoConfig, state dict in OASR names, tokenizer)``."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oasr.errors import CheckpointError
from oasr_models_nemo.config import NemoConfig, from_hf, from_nemo
from oasr_models_nemo.nn import rename_nemo, rename_nemotron, to_oasr_state
from oasr_models_nemo.tokenizer import (
    SentencePieceDecoder,
    load_tokenizer,
    read_sentencepiece_model,
)

if TYPE_CHECKING:
    from oasr_models_nemo.model import NemoASR

WEIGHTS = "model.safetensors"
HF_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    elif (path / "model.safetensors.index.json").is_file():
        index = json.loads((path / "model.safetensors.index.json").read_text())
        files = [path / f for f in sorted(set(index["weight_map"].values()))]
    else:
        raise CheckpointError(f"{path} has no model.safetensors (or its index)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is the user's to fix
            raise CheckpointError(f"cannot read {f}: {exc}") from exc
    return state


def load_hf(path: Path) -> tuple[NemoConfig, dict[str, torch.Tensor], SentencePieceDecoder]:
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {exc}") from exc
    pre = None
    if (path / "preprocessor_config.json").is_file():
        pre = json.loads((path / "preprocessor_config.json").read_text())
        pre = pre.get("feature_extractor", pre)  # a processor_config.json style nesting
    proc = {}
    if (path / "processor_config.json").is_file():
        proc = json.loads((path / "processor_config.json").read_text())
        if pre is None and isinstance(proc.get("feature_extractor"), dict):
            pre = proc["feature_extractor"]
    if proc.get("supported_num_lookahead_tokens"):  # the streaming processor's trained set
        cfg = {**cfg, "supported_num_lookahead_tokens": proc["supported_num_lookahead_tokens"]}
    config = from_hf(cfg, pre)
    state = _read_safetensors(path)
    if config.streaming:
        state = rename_nemotron(state)
    tokenizer = load_tokenizer(path)
    return config, to_oasr_state(state), tokenizer


# -- .nemo -------------------------------------------------------------------------------------------


def find_nemo_file(path: Path) -> Path | None:
    """``path`` itself when it is a ``.nemo`` archive, or the only ``.nemo`` in a directory."""
    path = Path(path)
    if path.is_file():
        return path if path.suffix == ".nemo" else None
    if path.is_dir():
        found = sorted(path.glob("*.nemo"))
        if len(found) == 1:
            return found[0]
    return None


def _nemo_members(archive: Path) -> dict[str, bytes]:
    try:
        with tarfile.open(archive, "r:*") as tar:
            out = {}
            for m in tar.getmembers():
                if not m.isfile():
                    continue
                name = Path(m.name).name
                if name == "model_weights.ckpt" or name.endswith((".yaml", ".model", ".txt", ".vocab")):
                    fh = tar.extractfile(m)
                    if fh is not None:
                        out[name] = fh.read()
            return out
    except (OSError, tarfile.TarError) as exc:
        raise CheckpointError(f"{archive} is not a readable .nemo archive (a tar): {exc}") from exc


def _nemo_dir_members(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in path.iterdir() if f.is_file() and (
        f.name == "model_weights.ckpt" or f.suffix in (".yaml", ".model", ".txt", ".vocab"))}


def load_nemo(path: Path) -> tuple[NemoConfig, dict[str, torch.Tensor], SentencePieceDecoder]:
    """A ``.nemo`` archive (or a directory holding one, or its extracted files): its
    ``model_config.yaml``, ``model_weights.ckpt`` and SentencePiece tokenizer. NeMo itself is not
    needed: the weights are a plain ``torch.save`` state dict, read with ``weights_only=True``."""
    import yaml

    path = Path(path)
    archive = find_nemo_file(path)
    members = _nemo_members(archive) if archive else _nemo_dir_members(path)
    where = archive or path
    if "model_config.yaml" not in members:
        raise CheckpointError(f"{where} has no model_config.yaml")
    if "model_weights.ckpt" not in members:
        raise CheckpointError(f"{where} has no model_weights.ckpt")
    try:
        cfg = yaml.safe_load(members["model_config.yaml"].decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{where}: model_config.yaml does not parse: {exc}") from exc
    config = from_nemo(cfg)
    try:
        state = torch.load(io.BytesIO(members["model_weights.ckpt"]), map_location="cpu",
                           weights_only=True)
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{where}: model_weights.ckpt is unreadable: {exc}") from exc
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    tok_name = str((cfg.get("tokenizer") or {}).get("model_path") or "").removeprefix("nemo:")
    tok_name = Path(tok_name).name
    models = [n for n in members if n.endswith(".model")]
    pick = tok_name if tok_name in members else (models[0] if len(models) == 1 else None)
    if pick is None:
        raise CheckpointError(f"{where} has no SentencePiece tokenizer (*.model); character "
                              f"vocabularies are not supported")
    tokenizer = SentencePieceDecoder(*read_sentencepiece_model(members[pick], pick))
    if config.is_transducer:  # hybrid TDT/RNN-T + CTC models: the auxiliary CTC head is unused
        state = {k: v for k, v in state.items() if not k.startswith("ctc_decoder.")}
    return config, to_oasr_state(rename_nemo(state)), tokenizer


# -- native ------------------------------------------------------------------------------------------


def save_native(dst: Path, model: NemoASR) -> str:
    from safetensors.torch import save_file

    from oasr.checkpoint import write_native_config

    dst.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.net.state_dict().items()}
    save_file(state, str(dst / WEIGHTS))
    arch = model.config.architecture
    write_native_config(dst, arch, {
        "nemo_config": model.config.to_json(),
        "tokenizer": {"kind": "sentencepiece", "pieces": model.tokenizer.pieces,
                      "types": model.tokenizer.types},
        "source_format": model.source_format,
    }, decoding=model.default_options)
    return arch


def load_native(path: Path, body: dict[str, Any]) -> tuple[NemoConfig, dict[str, torch.Tensor], SentencePieceDecoder]:
    from safetensors.torch import load_file

    try:
        config = NemoConfig.from_json(body["nemo_config"]).check()
        tok = body["tokenizer"]
        tokenizer = SentencePieceDecoder(tok["pieces"], tok.get("types"))
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: incomplete oasr_model.json ({exc})") from exc
    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read {path / WEIGHTS}: {exc}") from exc
    return config, state, tokenizer

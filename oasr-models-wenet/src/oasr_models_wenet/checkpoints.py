"""Loading WeNet's recipe directory and OASR's native format for WeNet models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from oasr.errors import CheckpointError
from oasr_models_wenet.config import (
    WenetConfig,
    find_units,
    find_weights,
    read_cmvn,
    read_units,
    read_yaml,
    resolve_cmvn_file,
)
from oasr_models_wenet.nn import convert_wenet_state
from oasr_models_wenet.plugin import ARCHITECTURE, LEGACY_KEYS  # the registry key, declared once

if TYPE_CHECKING:
    from oasr_models_wenet.model import WenetASR

WEIGHTS = "model.safetensors"


def load_wenet(path: Path) -> tuple[WenetConfig, dict[str, torch.Tensor], list[str]]:
    """Read ``train.yaml``, the unit table, the ``.pt`` state dict and (when the checkpoint does
    not carry it) the global CMVN file. Returns (config, state dict in OASR names, units)."""
    path = Path(path)
    if path.is_file():
        path = path.parent
    yaml_path = path / "train.yaml"
    if not yaml_path.is_file():
        raise CheckpointError(f"{path} has no train.yaml; it is not a WeNet model directory")
    raw = read_yaml(yaml_path)
    units_path = find_units(path)
    if units_path is None:
        raise CheckpointError(f"{path} has no units.txt (or words.txt / lang_char.txt)")
    units = read_units(units_path)
    cfg = WenetConfig.from_yaml_dict(raw, vocab_size=len(units))
    weights = find_weights(path)
    if weights is None:
        raise CheckpointError(f"{path} has no final.pt / avg_*.pt weights")
    try:
        sd = torch.load(weights, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"cannot read {weights}: {type(exc).__name__}: {exc}") from exc
    if isinstance(sd, dict) and "model" in sd and isinstance(sd["model"], dict):
        sd = sd["model"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{weights} does not hold a state dict of tensors")
    state = convert_wenet_state(sd, cfg)
    if "encoder.global_cmvn.mean" not in state:
        cmvn = resolve_cmvn_file(path, raw)
        if cmvn is not None and raw.get("cmvn", "global_cmvn") is not None:
            mean, istd = read_cmvn(cmvn)
            if len(mean) != cfg.input_dim:
                raise CheckpointError(
                    f"{cmvn} has {len(mean)} dimensions but the model takes {cfg.input_dim} features"
                )
            state["encoder.global_cmvn.mean"] = torch.tensor(mean, dtype=torch.float32)
            state["encoder.global_cmvn.istd"] = torch.tensor(istd, dtype=torch.float32)
    return cfg, state, units


def save_native(dst: Path, model: WenetASR) -> str:
    from safetensors.torch import save_file

    from oasr.checkpoint import write_native_config

    dst.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.net.state_dict().items()}
    save_file(state, str(dst / WEIGHTS))
    cfg = model.config.to_json()
    write_native_config(dst, ARCHITECTURE, {
        "wenet_config": cfg,
        "units": list(model.units.pieces),
        "source_format": model.source_format,
        "tokenizer": {"kind": "wenet_units"},
    }, feature_spec=model.feature_spec, decoding=model.default_options)
    return ARCHITECTURE


def load_native(path: Path, body: dict[str, Any] | None = None) -> tuple[WenetConfig, dict[str, torch.Tensor], list[str]]:
    from safetensors.torch import load_file

    from oasr.checkpoint import read_native_config

    body = body or read_native_config(path)
    if body.get("architecture") not in (ARCHITECTURE, *LEGACY_KEYS):
        raise CheckpointError(f"{path} holds architecture {body.get('architecture')!r}, not {ARCHITECTURE}")
    try:
        cfg = WenetConfig.from_json(body["wenet_config"])
        units = list(body["units"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: incomplete oasr_model.json ({exc})") from exc
    try:
        state = load_file(str(path / WEIGHTS))
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read {path / WEIGHTS}: {exc}") from exc
    return cfg, state, units


def native_json(path: Path) -> dict[str, Any]:
    return json.loads((path / "oasr_model.json").read_text())

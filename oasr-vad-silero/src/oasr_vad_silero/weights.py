"""Checkpoints: where the weights come from and how their names map onto :mod:`.network`.

Accepted sources (``load_state(path)``):

* ``None`` (default): the ``silero_vad.jit`` TorchScript model shipped in the ``silero-vad``
  package (its ``state_dict``; 16 kHz and 8 kHz). The package is located without importing it
  (importing ``silero_vad`` sets ``torch.set_num_threads(1)`` process-wide).
* a TorchScript file (``.jit`` / ``.pt``) with the same layout (``_model.*``, ``_model_8k.*``).
* ``silero_vad_16k.safetensors`` from the same package (flat names ``stft_conv``, ``conv1..4``,
  ``lstm_cell``, ``final_conv``; 16 kHz only). Note: these are *different* weights from the
  ``.jit`` (a separately trained 16 kHz model), so its probabilities differ from the default.
* OASR's own export (:func:`save_oasr`): safetensors with ``16k.*`` / ``8k.*`` names and
  ``{"format": "oasr-vad-silero"}`` metadata. A directory holding ``model.safetensors`` works too.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch

OASR_FORMAT = "oasr-vad-silero"
PACKAGE_JIT = "silero_vad.jit"
PACKAGE_SAFETENSORS = "silero_vad_16k.safetensors"
PREFIX = {16000: "16k", 8000: "8k"}


def package_data_file(name: str = PACKAGE_JIT) -> Path:
    """Path of a file in ``silero_vad/data`` without importing ``silero_vad``."""
    from oasr.errors import CheckpointError

    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the default Silero VAD weights come from the silero-vad package: "
            "pip install silero-vad (or pass the path of a .jit / .safetensors checkpoint)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    if not path.is_file():
        raise CheckpointError(f"silero-vad is installed but {path} is missing; reinstall it")
    return path


def _rate_map(src: str) -> dict[str, str]:
    """Our parameter names (one sub-model) -> the TorchScript names under ``src``."""
    m = {"stft.weight": f"{src}.stft.forward_basis_buffer"}
    for i in range(4):
        m[f"encoder.{i}.weight"] = f"{src}.encoder.{i}.reparam_conv.weight"
        m[f"encoder.{i}.bias"] = f"{src}.encoder.{i}.reparam_conv.bias"
    for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        m[f"lstm.{p}"] = f"{src}.decoder.rnn.{p}"
    m["head.weight"] = f"{src}.decoder.decoder.2.weight"
    m["head.bias"] = f"{src}.decoder.decoder.2.bias"
    return m


_FLAT_16K = {
    "stft.weight": "stft_conv.weight",
    **{f"encoder.{i}.{k}": f"conv{i + 1}.{k}" for i in range(4) for k in ("weight", "bias")},
    **{f"lstm.{p}": f"lstm_cell.{p}" for p in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")},
    "head.weight": "final_conv.weight",
    "head.bias": "final_conv.bias",
}


def _pick(sd: dict[str, torch.Tensor], mapping: dict[str, str]) -> dict[str, torch.Tensor]:
    from oasr.errors import CheckpointError

    missing = [v for v in mapping.values() if v not in sd]
    if missing:
        raise CheckpointError(f"not a Silero VAD checkpoint: missing {', '.join(missing[:4])}")
    return {ours: sd[theirs].detach().to(torch.float32).clone() for ours, theirs in mapping.items()}


def from_torchscript_state(sd: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    out = {16000: _pick(sd, _rate_map("_model"))}
    if any(k.startswith("_model_8k.") for k in sd):
        out[8000] = _pick(sd, _rate_map("_model_8k"))
    return out


def from_safetensors_state(sd: dict[str, torch.Tensor]) -> dict[int, dict[str, torch.Tensor]]:
    from oasr.errors import CheckpointError

    if "stft_conv.weight" in sd:  # the silero-vad package's flat 16 kHz export
        return {16000: _pick(sd, _FLAT_16K)}
    out: dict[int, dict[str, torch.Tensor]] = {}
    for rate, prefix in PREFIX.items():
        sub = {k[len(prefix) + 1 :]: v for k, v in sd.items() if k.startswith(prefix + ".")}
        if sub:
            out[rate] = _pick(sub, {k: k for k in _FLAT_16K})
    if not out:
        raise CheckpointError("safetensors file holds no Silero VAD weights")
    return out


def load_state(path: str | os.PathLike[str] | None = None) -> dict[int, dict[str, torch.Tensor]]:
    """Weights per sample rate, in :class:`~.network.SileroVADNet` names."""
    from oasr.errors import CheckpointError

    p = package_data_file() if path is None else Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise CheckpointError(f"Silero VAD checkpoint not found: {p}")
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return from_safetensors_state(load_file(str(p)))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load in torch >= 2.10
            module = torch.jit.load(str(p), map_location="cpu")
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"cannot read {p} as a TorchScript Silero VAD model: {exc}") from exc
    return from_torchscript_state(dict(module.state_dict()))


def save_oasr(states: dict[int, dict[str, torch.Tensor]], path: str | os.PathLike[str]) -> Path:
    """Write OASR's native single-file format (loads with no conversion)."""
    from safetensors.torch import save_file

    flat = {
        f"{PREFIX[rate]}.{k}": v.detach().to("cpu", torch.float32).contiguous()
        for rate, sd in states.items()
        for k, v in sd.items()
    }
    p = Path(path)
    if p.suffix != ".safetensors":
        p.mkdir(parents=True, exist_ok=True)
        p = p / "model.safetensors"
    save_file(flat, str(p), metadata={"format": OASR_FORMAT})
    return p

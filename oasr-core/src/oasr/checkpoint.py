"""Checkpoint resolution (local directory or Hugging Face Hub id), format detection, and OASR's
native format.

Formats are registered on the ``checkpoint_format`` axis; each has a cheap ``detect(path)`` and a
``load(path, config)``. Detection tries formats in descending ``priority`` and takes the first
match, so a native checkpoint (which may also contain e.g. a config.json) wins.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oasr.errors import CheckpointError, PluginLoadError, UnknownModelError
from oasr.model import SupportsNativeFormat
from oasr.plugins import get_plugin_manager, get_registry

if TYPE_CHECKING:
    from oasr.model import ASRModel
    from oasr.types import EngineConfig

NATIVE_CONFIG = "oasr_model.json"
NATIVE_FORMAT_VERSION = 1
#: a quantized native checkpoint: version 1 plus quantized weights (oasr.quantization.checkpoint)
QUANTIZED_FORMAT_VERSION = 2
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_checkpoint_dir(ckpt: str | Path) -> Path:
    """A local directory as is; otherwise a Hub repo id resolved through ``huggingface_hub``
    (its cache, ``HF_HOME`` and ``HF_HUB_OFFLINE`` are honoured)."""
    path = Path(ckpt).expanduser()
    if path.exists():
        # a directory, or a single-file checkpoint (openai-whisper's .pt) that the format
        # detectors open with the file as the path
        return path
    text = str(ckpt)
    if not _HUB_ID.match(text):
        raise UnknownModelError(
            f"checkpoint {text!r} is neither an existing local path nor a Hugging Face Hub id "
            f"like 'openai/whisper-tiny'"
        )
    from huggingface_hub import snapshot_download  # a core dependency, imported only for Hub ids

    try:
        return Path(snapshot_download(repo_id=text))
    except Exception as exc:  # noqa: BLE001 - network/cache errors: tell the user what to do
        raise UnknownModelError(
            f"could not fetch {text!r} from the Hugging Face Hub ({type(exc).__name__}: {exc}); "
            f"download it first (hf download {text}, from huggingface_hub >= 0.34; older "
            f"releases: huggingface-cli download {text}) or pass a local directory"
        ) from exc


def detect_format(path: Path) -> str:
    """Return the registry key of the first format (by priority) that recognises ``path``."""
    registry = get_registry("checkpoint_format")
    specs = sorted(registry, key=lambda s: -int(s.metadata.get("priority", 0)))
    for spec in specs:
        if spec.load().detect(path):
            return spec.key
    known = ", ".join(s.key for s in specs) or "none"
    failures = get_plugin_manager().failures
    if failures:
        # the format that would have recognised it may belong to a plugin that did not load
        first = failures[0]
        raise PluginLoadError(
            first.distribution, first.cause,
            needed_for=f"a format for the checkpoint at {path} (formats tried: {known})",
        )
    raise UnknownModelError(
        f"no installed plugin recognises the checkpoint at {path} (formats tried: {known}); "
        f"install the model family's plugin (see `oasr models`)"
    )


def _strict_float32(model: ASRModel) -> None:
    """A model running float32 on CUDA gets float32 convolutions: PyTorch lets cuDNN compute
    them in TF32 by default (10 mantissa bits) and picks its algorithm per shape, so the same
    audio decoded in another batch (a server step of 12 streams, a test's step of 500) came out
    different at near-tied tokens. fp16/bf16 models are unaffected (the switch concerns float32
    only); ``OASR_ALLOW_TF32=1`` keeps PyTorch's default. Matmuls are float32 by default."""
    import torch

    net = getattr(model, "net", None)  # every family's network; else the model's own fields
    first = next(net.parameters(), None) if isinstance(net, torch.nn.Module) else None
    device, dtype = ((first.device, first.dtype) if first is not None
                     else (getattr(model, "device", None), getattr(model, "dtype", None)))
    if (isinstance(device, torch.device) and device.type == "cuda" and dtype == torch.float32
            and torch.backends.cudnn.allow_tf32):
        from oasr.defaults import env_switch

        if not env_switch("OASR_ALLOW_TF32", False):
            torch.backends.cudnn.allow_tf32 = False


def load_model(config: EngineConfig) -> ASRModel:
    """Resolve, detect and load the checkpoint named by ``config.ckpt_dir``."""
    if config.ckpt_dir is None:
        # the CLI's and the server's default: the installed Whisper tiny.en (or an error that
        # says how to install it or what to pass instead)
        from oasr.defaults import default_checkpoint

        path = default_checkpoint()
    else:
        path = resolve_checkpoint_dir(config.ckpt_dir)
    fmt = detect_format(path)
    # Every model reaches its device here: install the kernel providers (plugins' op overrides)
    # for that device type first, once per process.
    from oasr.kernel_providers import install_kernel_providers

    install_kernel_providers(config.device)
    model = get_registry("checkpoint_format").resolve(fmt).load(path, config)
    _strict_float32(model)
    if config.quantization is not None and getattr(model, "quantization", None) is None:
        # online quantization (a quantized native checkpoint arrives quantized already)
        from oasr.quantization.apply import quantize_model

        quantize_model(model, config.quantization, source=path)  # path: the weights' disk cache key
    return model


# -- native format -------------------------------------------------------------------------------


def hf_model_type(path: Path) -> str | None:
    """The ``model_type`` of a Hugging Face directory's ``config.json`` (None: no readable one).
    Cheap and torch-free: what format detectors of ``save_pretrained`` layouts key on."""
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("model_type") if isinstance(cfg, dict) else None


def write_native_config(
    dst: Path,
    architecture: str,
    config: dict[str, Any],
    *,
    feature_spec: Any = None,
    decoding: Any = None,
) -> None:
    """Write ``oasr_model.json``: the family's ``config`` plus, in one shape for every family,
    its ``feature_spec`` (a :class:`~oasr.types.FeatureSpec`) and ``decoding`` (the model's
    :class:`~oasr.options.ModelOptions` defaults, which travel with the checkpoint and come
    back through ``ModelOptions.with_saved``)."""
    import dataclasses

    dst.mkdir(parents=True, exist_ok=True)
    body = {"format_version": NATIVE_FORMAT_VERSION, "architecture": architecture, **config}
    if feature_spec is not None:
        body["feature_spec"] = dataclasses.asdict(feature_spec)
    if decoding is not None:
        body["decoding"] = decoding.as_dict()
    (dst / NATIVE_CONFIG).write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")


def read_native_config(path: Path) -> dict[str, Any]:
    """The parsed ``oasr_model.json``. Its ``architecture`` is returned as the canonical registry
    key, so a checkpoint written under an older key (an alias, e.g. ``wenet_conformer``) loads."""
    try:
        body = json.loads((path / NATIVE_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path / NATIVE_CONFIG} is unreadable: {exc}") from exc
    if body.get("format_version") not in (NATIVE_FORMAT_VERSION, QUANTIZED_FORMAT_VERSION):
        raise CheckpointError(
            f"{path} uses native format version {body.get('format_version')!r}; this OASR reads "
            f"versions {NATIVE_FORMAT_VERSION} and {QUANTIZED_FORMAT_VERSION}: re-run `oasr convert` "
            f"from the original checkpoint"
        )
    if body["format_version"] == QUANTIZED_FORMAT_VERSION and not isinstance(body.get("quantization"), dict):
        raise CheckpointError(f"{path / NATIVE_CONFIG} is version {QUANTIZED_FORMAT_VERSION} without "
                              f"a quantization block")  # fmt: skip
    arch = body.get("architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError(f"{path / NATIVE_CONFIG} names no architecture")
    body["architecture"] = get_registry("architecture").canonical(arch)
    return body


class NativeFormat:
    """``oasr_model.json`` + ``model.safetensors`` + tokenizer assets, written by ``oasr convert``.
    The architecture class named in the json loads it with ``from_native``."""

    @staticmethod
    def detect(path: Path) -> bool:
        return path.is_dir() and (path / NATIVE_CONFIG).is_file()

    @staticmethod
    def load(path: Path, config: EngineConfig) -> ASRModel:
        body = read_native_config(path)
        arch = get_registry("architecture").resolve(body["architecture"])
        if not isinstance(arch, SupportsNativeFormat):
            raise CheckpointError(
                f"{path} names architecture {body['architecture']!r}, whose plugin cannot read the "
                f"native format (no from_native/save_native, see oasr.model.SupportsNativeFormat)"
            )
        model = arch.from_native(path, body, config)
        if body["format_version"] == QUANTIZED_FORMAT_VERSION:
            from oasr.quantization.checkpoint import apply_saved

            apply_saved(model, path, body["quantization"], config.quantization)
        return model


def convert_checkpoint(src: str | Path, dst: str | Path, config: EngineConfig | None = None) -> str:
    """Load ``src`` in whatever format and write OASR's native format to ``dst``.
    Returns the architecture key written."""
    from oasr.types import EngineConfig

    dst = Path(dst)
    if dst.exists() and not dst.is_dir():
        raise CheckpointError(f"{dst} exists and is not a directory; name a new or existing directory")
    cfg = config or EngineConfig(ckpt_dir=str(src))
    if cfg.ckpt_dir is None:
        cfg.ckpt_dir = str(src)
    model = load_model(cfg)
    if not isinstance(model, SupportsNativeFormat):
        raise CheckpointError(f"{model.name} does not support conversion to the native format")
    before = set(dst.rglob("*")) if dst.is_dir() else set()
    arch = model.save_native(dst)
    # some writers (safetensors) create files 0600; give the new files the usual umask mode
    umask = os.umask(0)
    os.umask(umask)
    for f in set(dst.rglob("*")) - before:
        if f.is_file():
            f.chmod(0o666 & ~umask)
    return arch

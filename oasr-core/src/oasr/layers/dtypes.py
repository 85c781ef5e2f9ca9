"""Names of compute dtypes, as users write them (``EngineConfig.dtype``, ``--dtype``), in one place."""

from __future__ import annotations

import torch

from oasr.errors import InvalidRequestError

__all__ = ["DTYPE_NAMES", "default_dtype", "resolve_dtype"]

#: accepted spellings (case-insensitive) -> torch dtype
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}  # fmt: skip


def resolve_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype ``name`` names; None for "auto" (or None): the model picks
    (:func:`default_dtype` of its device). Anything else is a typed 400 error."""
    if name is None or name == "auto":
        return None
    try:
        return DTYPE_NAMES[name.lower()]
    except (KeyError, AttributeError):
        raise InvalidRequestError(
            f"dtype {name!r} is not supported; use auto, float32, float16 or bfloat16", param="dtype"
        ) from None


def default_dtype(device: torch.device | str) -> torch.dtype:
    """What "auto" means: float32 on the CPU (and anything that is not CUDA), float16 on CUDA."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.float32

"""Qwen2-Audio's own decoding options (``DecodingOptions.model_options`` for ``speech_llm``).

The common options map as follows: ``temperature`` (its first value; 0, the default, is greedy),
``max_new_tokens``, ``task`` (transcribe / translate), ``language`` (the language to transcribe
or to translate from; it goes into the prompt) and ``prompt`` (the instruction given to the model
instead of the default one for the task)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from oasr.options import ModelOptions, ResolvedOptions, option
from oasr.types import DecodingOptions

__all__ = ["DEFAULT_OPTIONS", "QwenOptions", "qwen_options"]

#: tokens generated per 30 s window when the request does not set max_new_tokens
DEFAULT_MAX_NEW_TOKENS = 256


@dataclass(frozen=True)
class QwenOptions(ModelOptions):
    family = "qwen"

    top_p: float | None = option(
        None, gt=0, le=1, doc="Sampling (temperature > 0): keep the smallest set of tokens whose "
                              "probability reaches top_p (unset: all).",
    )  # fmt: skip
    top_k: int | None = option(
        None, ge=0, doc="Sampling (temperature > 0): keep the top_k most likely tokens (unset or 0: all)."
    )
    repetition_penalty: float = option(
        1.0, gt=0, doc="transformers' repetition penalty over the prompt and the generated tokens "
                       "(1: none; > 1 discourages repeats). Applies to greedy decoding too.",
    )  # fmt: skip
    seed: int | None = option(
        None, ge=0, doc="Seed of this request's sampler: the same seed gives the same text, whatever "
                        "else is decoded in the same batch.",
    )  # fmt: skip
    system_prompt: str | None = option(
        None, doc="Chat prompt style: the system message (unset: the checkpoint template's default)."
    )
    long_form: Literal["vad", "fixed"] = option(
        "vad", doc="Audio over 30 s: vad cuts it into windows of at most 30 s at the silences the "
                   "voice activity detector finds (silence is not decoded); fixed cuts every 30 s.",
    )  # fmt: skip
    prompt_style: Literal["auto", "chat", "base"] = option(
        "auto", doc="chat: the Instruct model's chat template; base: the base model's "
                    "'Detect the language and recognize the speech' prompt; auto: chat when the "
                    "checkpoint has a chat template.",
    )  # fmt: skip


DEFAULT_OPTIONS = QwenOptions()


def qwen_options(options: DecodingOptions | ResolvedOptions) -> ResolvedOptions:
    """``options`` with Qwen's options resolved (cheap when they already are)."""
    return DEFAULT_OPTIONS.resolve(options)

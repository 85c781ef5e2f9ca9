"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        "whisper",
        "oasr_models_whisper.model:WhisperASR",
        decode_family="aed",
        offline=True,
        streaming=False,
        word_timestamps=True,
        source_formats=["hf", "ctranslate2", "openai-whisper", "oasr"],
        description="OpenAI Whisper (tiny ... large-v3, turbo, distil, .en)",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register("whisper-hf", "oasr_models_whisper.formats:HFWhisperFormat", architecture="whisper", priority=10)
    register("whisper-ctranslate2", "oasr_models_whisper.formats:CT2WhisperFormat", architecture="whisper", priority=20)
    register("whisper-openai", "oasr_models_whisper.formats:OpenAIWhisperFormat", architecture="whisper", priority=10)


@hookimpl
def register_tokenizers(register: Register) -> None:
    register("whisper_bpe", "oasr_models_whisper.tokenizer:WhisperTokenizer")

"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

``CAPABILITIES`` is what the Whisper architecture can do. It is registered here and
``WhisperASR.capabilities`` is the same constant (an English-only checkpoint narrows it per
instance), so ``oasr models`` and the model cannot disagree."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

ARCHITECTURE = "whisper"
CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.AED,
    offline=True,
    streaming=False,
    word_timestamps=True,
    translation=True,
    language_detection=True,
    multilingual=True,
)


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        ARCHITECTURE,
        "oasr_models_whisper.model:WhisperASR",
        capabilities=CAPABILITIES,
        source_formats=["hf", "ctranslate2", "openai-whisper", "oasr"],
        description="OpenAI Whisper (tiny ... large-v3, turbo, distil, .en)",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register("whisper-hf", "oasr_models_whisper.formats:HFWhisperFormat", architecture=ARCHITECTURE, priority=10)
    register("whisper-ctranslate2", "oasr_models_whisper.formats:CT2WhisperFormat", architecture=ARCHITECTURE, priority=20)
    register("whisper-openai", "oasr_models_whisper.formats:OpenAIWhisperFormat", architecture=ARCHITECTURE, priority=10)


@hookimpl
def register_tokenizers(register: Register) -> None:
    register("whisper_bpe", "oasr_models_whisper.tokenizer:WhisperTokenizer")

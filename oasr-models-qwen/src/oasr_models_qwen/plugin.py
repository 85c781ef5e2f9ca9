"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

``CAPABILITIES`` is what the Qwen2-Audio architecture can do; ``Qwen2AudioASR.capabilities`` is
the same constant, so ``oasr models`` and the model cannot disagree."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

#: the registry key (the seed's); ``qwen2_audio`` (the transformers model type) is an alias
ARCHITECTURE = "speech_llm"
ALIASES = ("qwen2_audio",)
CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.LLM,
    offline=True,
    streaming=False,
    word_timestamps=False,
    translation=True,
    language_detection=False,
    multilingual=True,
)


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        ARCHITECTURE,
        "oasr_models_qwen.model:Qwen2AudioASR",
        aliases=ALIASES,
        capabilities=CAPABILITIES,
        source_formats=["hf"],
        description="Qwen2-Audio speech-LLM (Qwen2-Audio-7B, -7B-Instruct), token-by-token decoding",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register(
        "qwen2-audio-hf",
        "oasr_models_qwen.formats:HFQwen2AudioFormat",
        architecture=ARCHITECTURE,
        priority=10,
        description="Hugging Face Qwen2-Audio: config.json (model_type qwen2_audio) + safetensors",
    )

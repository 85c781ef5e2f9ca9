"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

``CAPABILITIES`` is what the Paraformer architecture can do; ``ParaformerASR.capabilities`` is
the same constant, so ``oasr models`` and the model cannot disagree."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

#: the registry key reserved for FunASR's Paraformer
ARCHITECTURE = "paraformer"
CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.CIF,
    offline=True,
    streaming=False,
    word_timestamps=True,
    translation=False,
    language_detection=False,
    multilingual=False,
    hotwords=True,  # SeACo-Paraformer checkpoints; the others narrow it per instance
)


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        ARCHITECTURE,
        "oasr_models_funasr.model:ParaformerASR",
        capabilities=CAPABILITIES,
        source_formats=["funasr", "oasr"],
        description="FunASR Paraformer / BiCif / SeACo (non-autoregressive CIF, timestamps, hotwords)",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register(
        "funasr",
        "oasr_models_funasr.formats:FunASRFormat",
        architecture=ARCHITECTURE,
        priority=10,
        description="FunASR release: config.yaml + model.pt + am.mvn + tokens.json/tokens.txt",
    )

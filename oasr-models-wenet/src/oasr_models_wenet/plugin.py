"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

``CAPABILITIES`` is what the WeNet Conformer architecture can do. It is registered here and
``WenetASR.capabilities`` is the same constant (a checkpoint trained without chunk masks narrows
it per instance: it cannot stream), so ``oasr models`` and the model cannot disagree."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

#: the registry key; ``wenet_conformer`` (its name before OASR 0.2) stays an alias
ARCHITECTURE = "conformer"
LEGACY_KEYS = ("wenet_conformer",)
CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.CTC,
    offline=True,
    streaming=True,
    hotwords=True,
    word_timestamps=True,
    translation=False,
    language_detection=False,
    multilingual=False,
)


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        ARCHITECTURE,
        "oasr_models_wenet.model:WenetASR",
        aliases=LEGACY_KEYS,
        capabilities=CAPABILITIES,
        source_formats=["wenet", "oasr"],
        description="WeNet Conformer U2/U2++ (CTC prefix beam + attention rescoring), streaming",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register(
        "wenet",
        "oasr_models_wenet.formats:WenetFormat",
        architecture=ARCHITECTURE,
        priority=10,
        description="WeNet recipe output: train.yaml + units.txt/words.txt + final.pt/avg_*.pt",
    )


@hookimpl
def register_vad_detectors(register: Register) -> None:
    register(
        "ctc_blank",
        "oasr_models_wenet.vad:CTCBlankVAD",
        sample_rates=[16000],
        streaming=True,
        description="speech probability = 1 - CTC blank posterior of a WeNet model, per encoder frame",
    )

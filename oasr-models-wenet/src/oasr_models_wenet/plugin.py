"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        "wenet_conformer",
        "oasr_models_wenet.model:WenetASR",
        decode_family="ctc",
        offline=True,
        streaming=True,
        word_timestamps=True,
        source_formats=["wenet", "oasr"],
        description="WeNet Conformer U2/U2++ (CTC prefix beam + attention rescoring), streaming",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register(
        "wenet",
        "oasr_models_wenet.formats:WenetFormat",
        architecture="wenet_conformer",
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

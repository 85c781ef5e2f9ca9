"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

Two architectures share one checkpoint format: an icefall checkpoint with a transducer head
(``joiner.*``) loads as ``transducer``, one with only a CTC head (``ctc_output.*``) as
``zipformer``. Their capabilities are declared once here and are the model classes' own."""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

CTC_ARCHITECTURE = "zipformer"
TRANSDUCER_ARCHITECTURE = "transducer"
CTC_CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.CTC, offline=True, streaming=True, word_timestamps=True,
    hotwords=True,
)
TRANSDUCER_CAPABILITIES = ModelCapabilities(
    decode_family=DecodeFamily.TRANSDUCER, offline=True, streaming=True, word_timestamps=True,
    hotwords=True,
)


@hookimpl
def register_architectures(register: Register) -> None:
    register(
        CTC_ARCHITECTURE,
        "oasr_models_icefall.model:ZipformerCTC",
        aliases=("zipformer_ctc",),
        capabilities=CTC_CAPABILITIES,
        source_formats=["icefall", "oasr"],
        description="icefall Zipformer, CTC head (greedy / prefix beam), streaming when causal",
    )
    register(
        TRANSDUCER_ARCHITECTURE,
        "oasr_models_icefall.model:ZipformerTransducer",
        aliases=("zipformer_transducer",),
        capabilities=TRANSDUCER_CAPABILITIES,
        source_formats=["icefall", "oasr"],
        description="icefall Zipformer transducer (greedy / modified beam search), streaming when causal",
    )


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register(
        "icefall",
        "oasr_models_icefall.formats:IcefallFormat",
        architecture=TRANSDUCER_ARCHITECTURE,
        priority=10,
        description="icefall experiment / release: exp/pretrained.pt or epoch-N.pt + tokens.txt or bpe.model",
    )

"""Hook module named by the ``oasr`` entry point. Must stay light: no torch import here.

One registry key per decode variant, each with its capabilities declared once here (the model
classes in ``model.py`` carry the same constants):

* ``parakeet_ctc``: FastConformer + CTC (``ParakeetForCTC``, NeMo ``EncDecCTCModelBPE``);
* ``parakeet_rnnt``: FastConformer + RNN-T (``ParakeetForRNNT``, ``EncDecRNNTBPEModel``);
* ``parakeet_tdt``: FastConformer + token-and-duration transducer (``ParakeetForTDT``);
* ``nemotron``: the cache-aware streaming FastConformer RNN-T (``NemotronAsrStreamingForRNNT``,
  NeMo's cache-aware streaming models), offline and streaming; ``fastconformer_rnnt`` is its
  older name.
"""

from __future__ import annotations

from oasr import hookimpl
from oasr.hookspecs import Register
from oasr.types import DecodeFamily, ModelCapabilities

CTC_CAPABILITIES = ModelCapabilities(decode_family=DecodeFamily.CTC, offline=True,
                                     streaming=False, word_timestamps=True)
RNNT_CAPABILITIES = ModelCapabilities(decode_family=DecodeFamily.TRANSDUCER, offline=True,
                                      streaming=False, word_timestamps=True)
TDT_CAPABILITIES = RNNT_CAPABILITIES
NEMOTRON_CAPABILITIES = ModelCapabilities(decode_family=DecodeFamily.TRANSDUCER, offline=True,
                                          streaming=True, word_timestamps=True)
SOURCE_FORMATS = ["hf-parakeet", "nemo", "oasr"]


@hookimpl
def register_architectures(register: Register) -> None:
    register("nemotron", "oasr_models_nemo.model:NemotronASR", aliases=["fastconformer_rnnt"],
             capabilities=NEMOTRON_CAPABILITIES, source_formats=SOURCE_FORMATS,
             description="NVIDIA Nemotron cache-aware streaming FastConformer RNN-T")
    register("parakeet_ctc", "oasr_models_nemo.model:ParakeetCTC",
             capabilities=CTC_CAPABILITIES, source_formats=SOURCE_FORMATS,
             description="NVIDIA Parakeet FastConformer CTC (greedy, prefix beam)")
    register("parakeet_rnnt", "oasr_models_nemo.model:ParakeetRNNT",
             capabilities=RNNT_CAPABILITIES, source_formats=SOURCE_FORMATS,
             description="NVIDIA Parakeet FastConformer RNN-T (greedy, modified beam)")
    register("parakeet_tdt", "oasr_models_nemo.model:ParakeetTDT",
             capabilities=TDT_CAPABILITIES, source_formats=SOURCE_FORMATS,
             description="NVIDIA Parakeet FastConformer TDT (greedy with durations)")


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    register("hf-parakeet", "oasr_models_nemo.formats:HFParakeetFormat", architecture="nemotron",
             priority=10,
             description="transformers Parakeet CTC/RNN-T/TDT or Nemotron streaming: config.json "
                         "+ model.safetensors + tokenizer")
    register("nemo", "oasr_models_nemo.formats:NemoArchiveFormat", architecture="nemotron",
             priority=5,
             description=".nemo archive (model_config.yaml + model_weights.ckpt + tokenizer)")

"""Core's own registrations, made through the same hooks a third-party plugin uses."""

from __future__ import annotations

from oasr.hookspecs import Register, hookimpl


@hookimpl
def register_checkpoint_formats(register: Register) -> None:
    # OASR's native format (written by `oasr convert`): it names its architecture itself.
    register("oasr", "oasr.checkpoint:NativeFormat", priority=100, description="OASR native")


@hookimpl
def register_feature_extractors(register: Register) -> None:
    register("whisper_logmel", "oasr.features.whisper:WhisperLogMel", description="Whisper log-mel")
    register("kaldi_fbank", "oasr.features.kaldi:KaldiFbank", description="Kaldi-compatible fbank")
    register(
        "funasr_fbank_lfr",
        "oasr.features.funasr:FunASRFbankLFR",
        description="FunASR fbank + LFR stacking + CMVN (Paraformer)",
    )
    register(
        "nemo_mel",
        "oasr.features.nemo:NemoMel",
        description="NeMo / FastConformer log-mel (per-feature normalised)",
    )

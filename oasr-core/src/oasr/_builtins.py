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


@hookimpl
def register_decoders(register: Register) -> None:
    # Generic CTC decoders (oasr.decoders.ctc); families call them directly or resolve by key.
    register("ctc_greedy", "oasr.decoders.ctc:ctc_greedy_search", decode_family="ctc",
             description="CTC best path (batched), peak times and confidences")
    register("ctc_prefix_beam", "oasr.decoders.ctc:ctc_prefix_beam_search", decode_family="ctc",
             description="CTC prefix beam search (WeNet-exact n-best, scores, Viterbi times)")
    register("ctc_prefix_beam_incremental", "oasr.decoders.ctc:CTCPrefixBeamSearch",
             decode_family="ctc", description="incremental CTC prefix beam search (streaming)")
    register("ctc_prefix_beam_batched", "oasr.decoders.ctc_gpu:ctc_prefix_beam_search_gpu",
             decode_family="ctc",
             description="CTC prefix beam search as batched tensor ops (GPU; host-search n-best)")
    register("ctc_prefix_beam_stream", "oasr.decoders.ctc_gpu:GPUCTCPrefixBeamSearch",
             decode_family="ctc", description="a stream's tensor prefix beam (step_streams batches)")
    register("attention_rescoring", "oasr.decoders.ctc:attention_rescoring", decode_family="ctc",
             description="U2/U2++ attention rescoring (reverse_weight, ctc_weight)")
    # Generic transducer decoders (oasr.decoders.transducer) over a family's TransducerNetwork.
    register("transducer_greedy", "oasr.decoders.transducer:transducer_greedy_search",
             decode_family="transducer",
             description="RNN-T greedy (batched; max_symbols_per_frame; icefall / NeMo)")
    register("transducer_greedy_incremental", "oasr.decoders.transducer:TransducerGreedySearch",
             decode_family="transducer", description="incremental RNN-T greedy (streaming)")
    register("transducer_modified_beam",
             "oasr.decoders.transducer:transducer_modified_beam_search",
             decode_family="transducer",
             description="icefall modified beam search (one symbol per frame, n-best, scores)")
    register("tdt_greedy", "oasr.decoders.transducer:tdt_greedy_search",
             decode_family="transducer",
             description="NeMo token-and-duration transducer greedy (token durations)")
    register("tdt_greedy_incremental", "oasr.decoders.transducer:TDTGreedySearch",
             decode_family="transducer", description="incremental TDT greedy (streaming)")

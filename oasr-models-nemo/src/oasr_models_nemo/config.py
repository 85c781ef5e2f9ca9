"""``NemoConfig``: everything OASR reads from a FastConformer checkpoint, from either layout.

* Hugging Face (as ``transformers`` writes ``ParakeetForCTC`` / ``ParakeetForRNNT`` /
  ``ParakeetForTDT`` / ``NemotronAsrStreamingForRNNT``): ``config.json`` (``model_type``
  ``parakeet_ctc`` / ``parakeet_rnnt`` / ``parakeet_tdt`` / ``nemotron_asr_streaming``, the
  ``encoder_config`` block) and ``preprocessor_config.json``;
* NeMo (``model_config.yaml`` inside a ``.nemo`` archive): ``encoder`` (``ConformerEncoder``),
  ``decoder`` (``ConvASRDecoder`` for CTC, ``RNNTDecoder``), ``joint`` (``RNNTJoint``, with
  ``num_extra_outputs`` duration logits for TDT), ``preprocessor``, ``decoding``.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from oasr.errors import CheckpointError

HF_MODEL_TYPES = {
    "parakeet_ctc": "ctc",
    "parakeet_rnnt": "rnnt",
    "parakeet_tdt": "tdt",
    "nemotron_asr_streaming": "rnnt",
}

# the registry key of each head (plugin.py registers them)
ARCHITECTURE_OF = {"ctc": "parakeet_ctc", "rnnt": "parakeet_rnnt", "tdt": "parakeet_tdt"}
STREAMING_ARCHITECTURE = "nemotron"


@dataclass
class NemoConfig:
    head: str  # "ctc" | "rnnt" | "tdt"
    vocab_size: int  # output classes, blank included (the CTC / joint token logits)
    blank_id: int
    # encoder (FastConformer)
    hidden_size: int = 1024
    num_layers: int = 24
    num_heads: int = 8
    intermediate_size: int = 4096
    conv_kernel_size: int = 9
    subsampling_factor: int = 8
    subsampling_channels: int = 256
    subsampling_kernel: int = 3
    subsampling_stride: int = 2
    num_mel_bins: int = 80
    attention_bias: bool = True
    convolution_bias: bool = True
    scale_input: bool = True
    activation: str = "silu"
    #: cache-aware streaming form (Nemotron): causal subsampling, causal depthwise convolution with
    #: a LayerNorm, chunked-limited attention
    causal: bool = False
    conv_norm: str = "batch_norm"  # or "layer_norm"
    #: attention context (left, right) in encoder frames; -1: unlimited
    att_context: tuple[int, int] = (-1, -1)
    att_context_style: str = "regular"  # or "chunked_limited"
    #: right contexts (lookaheads) the streaming model was trained with
    lookaheads: tuple[int, ...] = ()
    max_position_embeddings: int = 5000
    # transducer
    decoder_hidden_size: int = 640
    num_decoder_layers: int = 2
    joint_activation: str = "relu"
    max_symbols_per_step: int = 10
    durations: tuple[int, ...] = ()
    # frontend (NeMo's mel)
    sample_rate: int = 16000
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    preemphasis: float | None = 0.97
    normalize: str | None = "per_feature"
    streaming: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return STREAMING_ARCHITECTURE if self.streaming else ARCHITECTURE_OF[self.head]

    @property
    def is_transducer(self) -> bool:
        return self.head in ("rnnt", "tdt")

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["att_context"] = list(self.att_context)
        d["lookaheads"] = list(self.lookaheads)
        d["durations"] = list(self.durations)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NemoConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        for k in ("att_context", "lookaheads", "durations"):
            if k in kw:
                kw[k] = tuple(int(x) for x in kw[k])
        return cls(**kw)

    def check(self) -> NemoConfig:
        if self.head not in ("ctc", "rnnt", "tdt"):
            raise CheckpointError(f"unknown FastConformer head {self.head!r}")
        if self.head == "tdt" and not self.durations:
            raise CheckpointError("a TDT model needs its durations (config 'durations', NeMo "
                                  "'model_defaults.tdt_durations')")
        if not 0 <= self.blank_id < self.vocab_size:
            raise CheckpointError(f"blank id {self.blank_id} is outside the vocabulary of "
                                  f"{self.vocab_size}")
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"hidden size {self.hidden_size} is not divisible by "
                                  f"{self.num_heads} heads")
        sub = self.subsampling_factor
        if sub < 2 or sub & (sub - 1) or self.subsampling_stride != 2:
            raise CheckpointError(f"only dw_striding subsampling by a power of two with stride 2 "
                                  f"is supported, got factor {sub}, stride "
                                  f"{self.subsampling_stride}")
        return self


def _feature_kw(pre: dict[str, Any] | None, *, normalize: str | None) -> dict[str, Any]:
    pre = pre or {}
    pe = pre.get("preemphasis", 0.97)
    return {
        "num_mel_bins": int(pre.get("feature_size", 80)),
        "sample_rate": int(pre.get("sampling_rate", 16000)),
        "n_fft": int(pre.get("n_fft", 512)),
        "win_length": int(pre.get("win_length", 400)),
        "hop_length": int(pre.get("hop_length", 160)),
        "preemphasis": None if not pe else float(pe),
        "normalize": normalize,
    }


def from_hf(cfg: dict[str, Any], preprocessor: dict[str, Any] | None = None) -> NemoConfig:
    """A ``transformers`` ``config.json`` (and ``preprocessor_config.json``)."""
    mt = cfg.get("model_type")
    if mt not in HF_MODEL_TYPES:
        raise CheckpointError(
            f"config.json has model_type {mt!r}; oasr-models-nemo reads "
            f"{', '.join(sorted(HF_MODEL_TYPES))}")
    head = HF_MODEL_TYPES[mt]
    enc = cfg.get("encoder_config") or {}
    streaming = mt == "nemotron_asr_streaming"
    if enc.get("num_key_value_heads", enc.get("num_attention_heads", 8)) != enc.get(
            "num_attention_heads", 8):
        raise CheckpointError("grouped-query attention is not a FastConformer layout")
    vocab = int(cfg.get("vocab_size", 1025))
    blank = int(cfg["pad_token_id"] if head == "ctc" else cfg.get("blank_token_id", vocab - 1))
    kw: dict[str, Any] = {
        "head": head,
        "vocab_size": vocab,
        "blank_id": blank,
        "hidden_size": int(enc.get("hidden_size", 1024)),
        "num_layers": int(enc.get("num_hidden_layers", 24)),
        "num_heads": int(enc.get("num_attention_heads", 8)),
        "intermediate_size": int(enc.get("intermediate_size", 4096)),
        "conv_kernel_size": int(enc.get("conv_kernel_size", 9)),
        "subsampling_factor": int(enc.get("subsampling_factor", 8)),
        "subsampling_channels": int(enc.get("subsampling_conv_channels", 256)),
        "subsampling_kernel": int(enc.get("subsampling_conv_kernel_size", 3)),
        "subsampling_stride": int(enc.get("subsampling_conv_stride", 2)),
        "attention_bias": bool(enc.get("attention_bias", True)),
        "convolution_bias": bool(enc.get("convolution_bias", True)),
        "scale_input": bool(enc.get("scale_input", True)),
        "activation": str(enc.get("hidden_act", "silu")),
        "max_position_embeddings": int(enc.get("max_position_embeddings", 5000)),
        "decoder_hidden_size": int(cfg.get("decoder_hidden_size", 640)),
        "num_decoder_layers": int(cfg.get("num_decoder_layers", 2)),
        "joint_activation": str(cfg.get("hidden_act", "relu")),
        "max_symbols_per_step": int(cfg.get("max_symbols_per_step", 10)),
        "durations": tuple(int(d) for d in cfg.get("durations", ())) if head == "tdt" else (),
        "streaming": streaming,
    }
    kw.update(_feature_kw(preprocessor, normalize=None if streaming else "per_feature"))
    if "num_mel_bins" in enc:
        kw["num_mel_bins"] = int(enc["num_mel_bins"])
    if streaming:
        # the trained lookaheads live in processor_config.json (load_hf passes them); without
        # it, every lookahead up to the default is accepted
        right = int(enc.get("default_num_lookahead_tokens", 13))
        kw.update(causal=True, conv_norm="layer_norm",
                  att_context=(int(enc.get("sliding_window", 71)) - 1, right),
                  att_context_style="chunked_limited",
                  lookaheads=tuple(int(x) for x in cfg.get("supported_num_lookahead_tokens", ())
                                   or range(right + 1)))
    return NemoConfig(**kw).check()


def from_nemo(cfg: dict[str, Any]) -> NemoConfig:
    """A NeMo ``model_config.yaml`` (parsed)."""
    enc = cfg.get("encoder") or {}
    target = str(enc.get("_target_", ""))
    if target and not target.endswith("ConformerEncoder"):
        raise CheckpointError(f"the .nemo encoder is {target}; oasr-models-nemo reads "
                              f"(Fast)ConformerEncoder models")
    if enc.get("subsampling", "dw_striding") != "dw_striding":
        raise CheckpointError(f"subsampling {enc.get('subsampling')!r} is not supported "
                              f"(FastConformer's dw_striding is)")
    if enc.get("self_attention_model", "rel_pos") not in ("rel_pos", "rel_pos_local_attn"):
        raise CheckpointError(f"self_attention_model {enc.get('self_attention_model')!r} is not "
                              f"supported (rel_pos is)")
    if enc.get("untie_biases", True) is False:
        raise CheckpointError("untie_biases: false (shared positional biases) is not supported")
    dec = cfg.get("decoder") or {}
    joint = cfg.get("joint") or {}
    dec_target = str(dec.get("_target_", ""))
    decoding = cfg.get("decoding") or {}
    defaults = cfg.get("model_defaults") or {}
    if "RNNTDecoder" in dec_target or joint:
        classes = int(joint.get("num_classes", dec.get("vocab_size", 0)))
        extra = int(joint.get("num_extra_outputs", 0) or 0)
        durations = tuple(int(d) for d in (decoding.get("durations")
                                           or defaults.get("tdt_durations") or ()))
        head = "tdt" if extra or durations else "rnnt"
        if head == "tdt" and extra and len(durations) != extra:
            raise CheckpointError(f"the joint has {extra} duration outputs but the config lists "
                                  f"durations {list(durations)}")
        vocab, blank = classes + 1, classes
        prednet = dec.get("prednet") or {}
        jointnet = joint.get("jointnet") or {}
        pred_hidden = int(prednet.get("pred_hidden", defaults.get("pred_hidden", 640)))
        joint_hidden = int(jointnet.get("joint_hidden", defaults.get("joint_hidden", pred_hidden)))
        if joint_hidden != pred_hidden:
            raise CheckpointError(f"joint_hidden {joint_hidden} != pred_hidden {pred_hidden} "
                                  f"is not supported")
        greedy = decoding.get("greedy") or {}
        tkw = {
            "decoder_hidden_size": pred_hidden,
            "num_decoder_layers": int(prednet.get("pred_rnn_layers", 2)),
            "joint_activation": str(jointnet.get("activation", "relu")),
            "max_symbols_per_step": int(greedy.get("max_symbols", 10) or 10),
            "durations": durations if head == "tdt" else (),
        }
    else:
        classes = int(dec.get("num_classes", 0))
        if classes <= 0:
            raise CheckpointError("the .nemo config's decoder has no num_classes")
        vocab, blank, head, tkw = classes + 1, classes, "ctc", {}
    pre = cfg.get("preprocessor") or {}
    sr = int(pre.get("sample_rate", cfg.get("sample_rate", 16000)))
    normalize = pre.get("normalize", "per_feature")
    if normalize in ("NA", "none", None, ""):
        normalize = None
    ctx = enc.get("att_context_size") or [-1, -1]
    lookaheads: tuple[int, ...] = ()
    if ctx and isinstance(ctx[0], (list, tuple)):  # multi-lookahead: the first is the default
        lookaheads = tuple(int(c[1]) for c in ctx)
        ctx = ctx[0]
    style = str(enc.get("att_context_style", "regular"))
    causal = bool(enc.get("causal_downsampling", False))
    conv_ctx = enc.get("conv_context_size")
    kw: dict[str, Any] = {
        "head": head,
        "vocab_size": vocab,
        "blank_id": blank,
        "hidden_size": int(enc.get("d_model", 1024)),
        "num_layers": int(enc.get("n_layers", 24)),
        "num_heads": int(enc.get("n_heads", 8)),
        "intermediate_size": int(enc.get("d_model", 1024)) * int(enc.get("ff_expansion_factor", 4)),
        "conv_kernel_size": int(enc.get("conv_kernel_size", 9)),
        "subsampling_factor": int(enc.get("subsampling_factor", 8)),
        "subsampling_channels": int(enc.get("subsampling_conv_channels", 256)),
        "num_mel_bins": int(enc.get("feat_in", pre.get("features", 80))),
        "attention_bias": bool(enc.get("use_bias", True)),
        "convolution_bias": bool(enc.get("use_bias", True)),
        "scale_input": bool(enc.get("xscaling", True)),
        "max_position_embeddings": int(enc.get("pos_emb_max_len", 5000)),
        "causal": causal or conv_ctx == "causal",
        "conv_norm": str(enc.get("conv_norm_type", "batch_norm")),
        "att_context": (int(ctx[0]), int(ctx[1])),
        "att_context_style": style,
        "lookaheads": lookaheads or ((int(ctx[1]),) if style == "chunked_limited" else ()),
        "streaming": style == "chunked_limited" and causal,
        "sample_rate": sr,
        "n_fft": int(pre.get("n_fft", 512)),
        "win_length": int(round(float(pre.get("window_size", 0.025)) * sr)),
        "hop_length": int(round(float(pre.get("window_stride", 0.01)) * sr)),
        "preemphasis": None if not pre.get("preemph", 0.97) else float(pre.get("preemph", 0.97)),
        "normalize": normalize,
        **tkw,
    }
    if kw["conv_norm"] not in ("batch_norm", "layer_norm"):
        raise CheckpointError(f"conv_norm_type {kw['conv_norm']!r} is not supported")
    return NemoConfig(**kw).check()

"""Hyper-parameters of an icefall Zipformer checkpoint, read from its state dict.

What the tensors determine is inferred from their names and shapes: the number of stacks and
layers per stack, every dimension, the downsampling factors (``downsample.bias`` has one weight
per input frame of a group), causal or not (a causal convolution has ``causal_conv``), kernel
sizes, the decoder's context size (its grouped convolution's width), the vocabulary and which
heads exist (transducer, CTC, attention decoder). The split of the attention projections into
heads is not determined by shapes alone (``(2 * query_head_dim + pos_head_dim) * num_heads``):
the recipe's ``pos_head_dim`` 4 / ``value_head_dim`` 12 / ``query_head_dim`` 32 decide it, and
an override file (``oasr_icefall.json`` beside the checkpoint, or ``model_config.json``) names
the values of a recipe that changed them, e.g. ``{"num_heads": "4,4,4,8,4,4"}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError
from oasr_models_icefall.nn import ZipformerConfig

OVERRIDE_FILES = ("oasr_icefall.json", "model_config.json")
#: icefall's egs/librispeech/ASR/zipformer/train.py defaults for what shapes cannot tell
RECIPE_DEFAULTS = {"query_head_dim": 32, "pos_head_dim": 4, "value_head_dim": 12}
#: streaming decode defaults (icefall's streaming_decode.py runs: --chunk-size 16
#: --left-context-frames 128, in 50 Hz frames after encoder_embed)
DEFAULT_CHUNK_SIZE = 16
DEFAULT_LEFT_CONTEXT = 128


def _shape(state: dict[str, Any], key: str) -> tuple[int, ...]:
    try:
        return tuple(state[key].shape)
    except KeyError:
        raise CheckpointError(f"the checkpoint has no tensor {key!r}; it is not an icefall Zipformer "
                              f"state dict (or it is truncated)") from None


def _tuple(value: Any, n: int) -> tuple[int, ...]:
    if isinstance(value, str):
        value = [int(v) for v in value.split(",")]
    if isinstance(value, int):
        value = [value]
    value = tuple(int(v) for v in value)
    return value * n if len(value) == 1 else value


def _split_heads(in_proj: int, pos: int, value: int, override: dict[str, Any], i: int) -> tuple[int, int, int, int]:
    """(num_heads, query_head_dim, pos_head_dim, value_head_dim) of stack ``i``."""
    if "num_heads" in override:
        candidates = [_tuple(override["num_heads"], i + 1)[i]]
    else:
        candidates = [h for h in range(1, pos + 1) if pos % h == 0 and value % h == 0
                      and in_proj % h == 0 and (in_proj // h - pos // h) % 2 == 0]  # fmt: skip
    best = None
    for h in candidates:
        p, v = pos // h, value // h
        q = (in_proj // h - p) // 2
        if p * h != pos or v * h != value or (2 * q + p) * h != in_proj or q <= 0:
            continue
        want = {k: _tuple(override.get(k, RECIPE_DEFAULTS[k]), i + 1)[i] for k in RECIPE_DEFAULTS}
        score = (p == want["pos_head_dim"]) * 4 + (v == want["value_head_dim"]) * 2 + (q == want["query_head_dim"])
        if best is None or score > best[0]:
            best = (score, h, q, p, v)
    if best is None:
        raise CheckpointError(f"encoder stack {i}: cannot split its attention projections into heads; "
                              f"name num_heads in {OVERRIDE_FILES[0]}")
    return best[1:]


def read_override(directory: Path | None) -> dict[str, Any]:
    if directory is None:
        return {}
    for name in OVERRIDE_FILES:
        p = directory / name
        if p.is_file():
            try:
                return dict(json.loads(p.read_text()))
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"{p}: not a JSON object: {exc}") from exc
    return {}


def infer_config(state: dict[str, Any], override: dict[str, Any] | None = None) -> ZipformerConfig:
    """The :class:`ZipformerConfig` of an icefall Zipformer state dict (see the module doc)."""
    override = dict(override or {})
    stacks = sorted({int(m.group(1)) for k in state if (m := re.match(r"encoder\.encoders\.(\d+)\.", k))})
    if not stacks or "encoder_embed.out.weight" not in state:
        raise CheckpointError("the checkpoint has no encoder.encoders.* / encoder_embed.* tensors: it is "
                              "not an icefall Zipformer (zipformer recipe) state dict; oasr-models-icefall "
                              "loads the zipformer recipe and the pruned_transducer_stateless2 Conformer")
    dims, layers, ds, heads, qd, pd, vd, ffs, kernels = [], [], [], [], [], [], [], [], []
    causal = False
    pos_dim = None
    for i in stacks:
        prefix = f"encoder.encoders.{i}."
        inner = prefix + ("encoder." if f"{prefix}downsample.bias" in state else "")
        ds.append(_shape(state, f"{prefix}downsample.bias")[0] if f"{prefix}downsample.bias" in state else 1)
        n = len({int(m.group(1)) for k in state if (m := re.match(re.escape(inner) + r"layers\.(\d+)\.", k))})
        layers.append(n)
        lp = inner + "layers.0."
        dims.append(_shape(state, lp + "norm.bias")[0])
        lin_pos = _shape(state, lp + "self_attn_weights.linear_pos.weight")
        pos_dim = lin_pos[1]
        h, q, p, v = _split_heads(_shape(state, lp + "self_attn_weights.in_proj.weight")[0], lin_pos[0],
                                  _shape(state, lp + "self_attn1.in_proj.weight")[0], override, len(heads))
        heads.append(h), qd.append(q), pd.append(p), vd.append(v)
        ffs.append(_shape(state, lp + "feed_forward2.in_proj.weight")[0])
        if lp + "conv_module1.depthwise_conv.causal_conv.weight" in state:
            causal = True
            kernels.append(_shape(state, lp + "conv_module1.depthwise_conv.chunkwise_conv.weight")[-1])
        else:
            kernels.append(_shape(state, lp + "conv_module1.depthwise_conv.weight")[-1])
    c1 = _shape(state, "encoder_embed.conv.0.weight")[0]
    c2 = _shape(state, "encoder_embed.conv.4.weight")[0]
    c3 = _shape(state, "encoder_embed.conv.7.weight")[0]
    out_width = _shape(state, "encoder_embed.out.weight")[1] // c3
    feature_dim = int(override.get("feature_dim", 80))
    if (((feature_dim - 1) // 2) - 1) // 2 != out_width:
        raise CheckpointError(f"encoder_embed.out expects {out_width} frequency groups, which "
                              f"{feature_dim}-bin features do not give; set feature_dim in {OVERRIDE_FILES[0]}")
    use_transducer = "joiner.output_linear.weight" in state
    use_ctc = "ctc_output.1.weight" in state
    if not (use_transducer or use_ctc):
        raise CheckpointError("the checkpoint has neither a transducer (joiner.*) nor a CTC "
                              "(ctc_output.1.*) head")
    vocab = _shape(state, "joiner.output_linear.weight" if use_transducer else "ctc_output.1.weight")[0]
    decoder_dim = joiner_dim = 512
    context = 2
    if use_transducer:
        decoder_dim = _shape(state, "decoder.embedding.weight")[1]
        joiner_dim = _shape(state, "joiner.encoder_proj.weight")[0]
        context = _shape(state, "decoder.conv.weight")[-1] if "decoder.conv.weight" in state else 1
    cfg = ZipformerConfig(
        feature_dim=feature_dim, layer_channels=(c1, c2, c3), downsampling_factor=tuple(ds),
        num_encoder_layers=tuple(layers), encoder_dim=tuple(dims), num_heads=tuple(heads),
        query_head_dim=tuple(qd), pos_head_dim=tuple(pd), value_head_dim=tuple(vd),
        feedforward_dim=tuple(ffs), cnn_module_kernel=tuple(kernels), pos_dim=int(pos_dim),
        causal=causal, vocab_size=int(vocab), blank_id=int(override.get("blank_id", 0)),
        use_transducer=use_transducer, decoder_dim=int(decoder_dim), context_size=int(context),
        joiner_dim=int(joiner_dim), use_ctc=use_ctc,
        use_attention_decoder=any(k.startswith("attention_decoder.") for k in state),
    )  # fmt: skip
    known = {f.name for f in fields(ZipformerConfig)}
    extra = {k: v for k, v in override.items() if k in known and k not in ("num_heads", "feature_dim", "blank_id")}
    if extra:
        n = cfg.num_stacks
        cfg = replace(cfg, **{k: (_tuple(v, n) if isinstance(getattr(cfg, k), tuple) else v)
                              for k, v in extra.items()})  # fmt: skip
    return cfg


def config_dict(cfg: ZipformerConfig) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v) for f in fields(cfg)}


def config_from_dict(d: dict[str, Any]) -> ZipformerConfig:
    known = {f.name: f for f in fields(ZipformerConfig)}
    return ZipformerConfig(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in known})

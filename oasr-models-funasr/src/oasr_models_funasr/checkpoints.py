"""Reading a FunASR release directory as published (``funasr/paraformer-zh`` and relatives).

| file | read |
|---|---|
| ``config.yaml`` | ``model`` (Paraformer / BiCifParaformer / SeacoParaformer; others refused by name), ``encoder`` + ``encoder_conf`` (SANMEncoder), ``decoder`` + ``decoder_conf`` (ParaformerSANMDecoder), ``predictor`` + ``predictor_conf`` (CifPredictorV2 / V3), ``frontend_conf`` (WavFrontend), ``model_conf`` (blank / sos / eos ids; SeACo's ``inner_dim``, ``bias_encoder_bid``, ``NO_BIAS``), ``seaco_decoder_conf`` |
| ``model.pt`` | the state dict (``torch.load(weights_only=True)``; a ``{"state_dict"| "model": ...}`` wrapper is accepted) |
| ``am.mvn`` | CMVN (Kaldi nnet1 text), through the core's FunASR frontend |
| ``tokens.json`` / ``tokens.txt`` | the token list (a JSON list, or one token per line) |
| ``configuration.json``, ``seg_dict`` | ``file_path_metas`` may rename the files above; ``seg_dict`` only serves text -> tokens (training), unused |
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError
from oasr_models_funasr.nn import DecoderConfig, EncoderConfig, PredictorConfig, SeacoConfig

#: model classes of config.yaml OASR runs, and what each needs
SUPPORTED_MODELS = {
    "Paraformer": ("CifPredictorV2",),
    "BiCifParaformer": ("CifPredictorV3",),
    "SeacoParaformer": ("CifPredictorV3", "CifPredictorV2"),
}
KNOWN_UNSUPPORTED = {
    "ContextualParaformer": "contextual Paraformer is not supported yet",
    "ParaformerStreaming": "streaming Paraformer is not supported yet",
}


@dataclass
class ParaformerConfig:
    model: str
    encoder: EncoderConfig
    decoder: DecoderConfig
    predictor: PredictorConfig
    vocab_size: int
    blank_id: int = 0
    sos: int = 1
    eos: int = 2
    frontend: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)
    seaco: SeacoConfig | None = None
    unk_symbol: str = "<unk>"


def _pick(conf: dict, cls: type, renames: dict[str, str] | None = None) -> dict:
    names = set(cls.__dataclass_fields__)
    out = {}
    for k, v in (conf or {}).items():
        k = (renames or {}).get(k, k)
        if k in names:
            out[k] = v
    return out


def parse_config(
    raw: dict[str, Any], vocab_size: int, name: str = "config.yaml"
) -> ParaformerConfig:
    model = raw.get("model")
    if model not in SUPPORTED_MODELS:
        why = KNOWN_UNSUPPORTED.get(
            str(model), "OASR runs Paraformer, BiCifParaformer and SeacoParaformer"
        )
        raise CheckpointError(f"{name}: model class {model!r} is not supported ({why})")
    enc_name = raw.get("encoder")
    if enc_name != "SANMEncoder":
        raise CheckpointError(f"{name}: encoder {enc_name!r} is not supported (only SANMEncoder)")
    ec = dict(raw.get("encoder_conf") or {})
    if ec.get("input_layer", "pe") != "pe":
        raise CheckpointError(
            f"{name}: encoder input_layer {ec.get('input_layer')!r} is not supported (only 'pe')"
        )
    if ec.get("selfattention_layer_type", "sanm") != "sanm":
        raise CheckpointError(f"{name}: encoder selfattention_layer_type must be 'sanm'")
    if not ec.get("normalize_before", True) or ec.get("concat_after", False):
        raise CheckpointError(
            f"{name}: only normalize_before=true, concat_after=false encoders are supported"
        )
    if ec.get("positionwise_layer_type", "linear") != "linear":
        raise CheckpointError(f"{name}: encoder positionwise_layer_type must be 'linear'")
    if ec.get("lora_list"):
        raise CheckpointError(
            f"{name}: LoRA encoders are not supported; merge the LoRA weights first"
        )
    fc = dict(raw.get("frontend_conf") or {})
    if raw.get("frontend", "WavFrontend") not in ("WavFrontend", "wav_frontend"):
        raise CheckpointError(
            f"{name}: frontend {raw.get('frontend')!r} is not supported (only WavFrontend)"
        )
    input_size = int(fc.get("n_mels", 80)) * int(fc.get("lfr_m", 1))
    enc_kw = _pick(ec, EncoderConfig)
    enc_kw["input_size"] = input_size
    if enc_kw.get("sanm_shfit") is None:
        enc_kw["sanm_shfit"] = 0
    enc = EncoderConfig(**enc_kw)
    if raw.get("decoder") != "ParaformerSANMDecoder":
        raise CheckpointError(
            f"{name}: decoder {raw.get('decoder')!r} is not supported (only ParaformerSANMDecoder)"
        )
    dec = _decoder_config(raw.get("decoder_conf") or {}, name, "decoder")
    if not dec.use_output_layer or dec.wo_input_layer:
        raise CheckpointError(f"{name}: the decoder needs its output layer and token embedding")
    pred_name = raw.get("predictor")
    want = SUPPORTED_MODELS[model]
    if pred_name not in want:
        raise CheckpointError(
            f"{name}: {model} needs predictor {' or '.join(want)}, not {pred_name!r}"
        )
    pc = dict(raw.get("predictor_conf") or {})
    pred = PredictorConfig(kind=pred_name, **_pick(pc, PredictorConfig))
    if pred.idim != enc.output_size:
        raise CheckpointError(
            f"{name}: predictor idim {pred.idim} != encoder output_size {enc.output_size}"
        )
    mc = dict(raw.get("model_conf") or {})
    if mc.get("share_embedding"):
        raise CheckpointError(f"{name}: share_embedding models are not supported")
    seaco = None
    if model == "SeacoParaformer":
        # FunASR builds the model from model_conf updated by every top-level key
        sc = {**mc, **{k: v for k, v in raw.items() if k not in ("model_conf",)}}
        if sc.get("bias_encoder_type", "lstm") != "lstm":
            raise CheckpointError(f"{name}: SeACo bias_encoder_type must be 'lstm'")
        if sc.get("seaco_decoder") != "ParaformerSANMDecoder":
            raise CheckpointError(
                f"{name}: seaco_decoder {sc.get('seaco_decoder')!r} is not supported "
                f"(only ParaformerSANMDecoder)"
            )
        seaco = SeacoConfig(
            inner_dim=int(sc.get("inner_dim", 256)),
            bias_encoder_bid=bool(sc.get("bias_encoder_bid", False)),
            no_bias=int(sc.get("NO_BIAS", 8377)),
            decoder=_decoder_config(sc.get("seaco_decoder_conf") or {}, name, "seaco_decoder"),
        )
        if seaco.inner_dim != enc.output_size:
            raise CheckpointError(f"{name}: SeACo inner_dim must equal the encoder output_size")
        if not 0 <= seaco.no_bias < vocab_size:
            raise CheckpointError(f"{name}: NO_BIAS {seaco.no_bias} is outside the vocabulary")
    return ParaformerConfig(
        model=model,
        encoder=enc,
        decoder=dec,
        predictor=pred,
        vocab_size=vocab_size,
        blank_id=int(mc.get("blank_id", 0)),
        sos=int(mc.get("sos", 1) if mc.get("sos", 1) is not None else vocab_size - 1),
        eos=int(mc.get("eos", 2) if mc.get("eos", 2) is not None else vocab_size - 1),
        frontend=fc,
        raw=raw,
        seaco=seaco,
        unk_symbol=str((raw.get("tokenizer_conf") or {}).get("unk_symbol", "<unk>")),
    )


def _decoder_config(dc: dict[str, Any], name: str, what: str) -> DecoderConfig:
    dc = dict(dc)
    if not dc.get("normalize_before", True) or dc.get("concat_after", False) or dc.get("lora_list"):
        raise CheckpointError(
            f"{name}: only plain pre-norm ParaformerSANMDecoder {what}s are supported"
        )
    if dc.get("input_layer", "embed") != "embed":
        raise CheckpointError(f"{name}: {what} input_layer must be 'embed'")
    kw = _pick(dc, DecoderConfig)
    kw.setdefault("kernel_size", 21)
    kw.setdefault("att_layer_num", 6)
    kw.setdefault("num_blocks", 6)
    return DecoderConfig(**kw)


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a YAML mapping")
    return data


def read_tokens(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    if path.suffix == ".json":
        try:
            tokens = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not JSON: {e}") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise CheckpointError(f"{path} must hold a JSON list of token strings")
        return tokens
    return [line.rstrip() for line in text.splitlines()]


@dataclass
class ReleaseFiles:
    config: Path
    weights: Path
    tokens: Path
    cmvn: Path | None


def release_files(path: Path) -> ReleaseFiles:
    """The files of a release directory, honouring ``configuration.json``'s
    ``file_path_metas`` the way FunASR does."""
    path = Path(path)
    metas: dict[str, Any] = {}
    cj = path / "configuration.json"
    if cj.is_file():
        try:
            metas = json.loads(cj.read_text(encoding="utf-8")).get("file_path_metas") or {}
        except (OSError, json.JSONDecodeError, AttributeError):
            metas = {}
    config = path / str(metas.get("config", "config.yaml"))
    weights = path / str(metas.get("init_param", "model.pt"))
    tok_meta = (metas.get("tokenizer_conf") or {}).get("token_list")
    tokens = None
    for cand in ([tok_meta] if tok_meta else []) + ["tokens.json", "tokens.txt"]:
        if (path / cand).is_file():
            tokens = path / cand
            break
    cmvn_meta = (metas.get("frontend_conf") or {}).get("cmvn_file", "am.mvn")
    cmvn = path / cmvn_meta if (path / cmvn_meta).is_file() else None
    for p, what in ((config, "config.yaml"), (weights, "model.pt")):
        if not p.is_file():
            raise CheckpointError(f"{path} has no {p.name}; a FunASR release needs {what}")
    if tokens is None:
        raise CheckpointError(
            f"{path} has no tokens.json or tokens.txt; a FunASR release needs its token list"
        )
    return ReleaseFiles(config, weights, tokens, cmvn)


def load_release(path: Path) -> tuple[ParaformerConfig, dict, list[str], Path | None]:
    """(config, state dict as stored, tokens, am.mvn path or None)."""
    import torch

    files = release_files(path)
    raw = read_yaml(files.config)
    tokens = read_tokens(files.tokens)
    cfg = parse_config(raw, len(tokens), name=str(files.config))
    try:
        sd = torch.load(files.weights, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many types for a bad file
        raise CheckpointError(f"cannot read {files.weights}: {type(exc).__name__}: {exc}") from exc
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"{files.weights} does not hold a state dict of tensors")
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    return cfg, sd, tokens, files.cmvn

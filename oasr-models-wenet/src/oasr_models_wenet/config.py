"""Reading WeNet's recipe layout: ``train.yaml``, the unit table, global CMVN statistics.

No torch here (the format detector and ``oasr models`` may import this module cheaply).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oasr.errors import CheckpointError

CONFIG_NAMES = ("train.yaml",)
UNIT_NAMES = ("units.txt", "words.txt", "lang_char.txt", "tokens.txt")


def find_units(path: Path) -> Path | None:
    for name in UNIT_NAMES:
        if (path / name).is_file():
            return path / name
    return None


def find_weights(path: Path) -> Path | None:
    """``final.pt``, else the ``avg_N.pt`` with the largest N, else the only ``*.pt``."""
    if (path / "final.pt").is_file():
        return path / "final.pt"
    avgs = sorted(path.glob("avg_*.pt"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    if avgs:
        return avgs[-1]
    pts = sorted(p for p in path.glob("*.pt") if p.is_file())
    if len(pts) == 1:
        return pts[0]
    if pts:
        raise CheckpointError(
            f"{path} holds several .pt files ({', '.join(p.name for p in pts)}) and none is "
            f"final.pt or avg_*.pt; keep only the checkpoint to load"
        )
    return None


@dataclass
class WenetConfig:
    """The parts of ``train.yaml`` OASR uses (plus the raw dict, kept for the native format)."""

    input_dim: int
    vocab_size: int
    # encoder
    output_size: int = 256
    attention_heads: int = 4
    linear_units: int = 2048
    num_blocks: int = 12
    input_layer: str = "conv2d"
    pos_enc_layer_type: str = "rel_pos"
    normalize_before: bool = True
    cnn_module_kernel: int = 15
    use_cnn_module: bool = True
    macaron_style: bool = True
    causal: bool = False
    cnn_module_norm: str = "batch_norm"
    activation_type: str = "swish"
    static_chunk_size: int = 0
    use_dynamic_chunk: bool = False
    encoder_norm_eps: float = 1e-5
    conv_norm_eps: float = 1e-5
    query_bias: bool = True
    key_bias: bool = True
    value_bias: bool = True
    conv_bias: bool = True
    mlp_bias: bool = True
    # decoder
    decoder: str = "bitransformer"
    decoder_heads: int = 4
    decoder_linear_units: int = 2048
    decoder_num_blocks: int = 6
    decoder_r_num_blocks: int = 0
    decoder_activation: str = "relu"
    decoder_normalize_before: bool = True
    # model / decoding
    ctc_weight: float = 0.5
    reverse_weight: float = 0.0
    blank_id: int = 0
    sos: int = -1
    eos: int = -1
    # frontend
    sample_rate: int = 16000
    num_mel_bins: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def subsampling_rate(self) -> int:
        return {"conv2d": 4, "conv2d6": 6, "conv2d8": 8}[self.input_layer]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> WenetConfig:
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in body.items() if k in names})

    @classmethod
    def from_yaml_dict(cls, cfg: dict[str, Any], vocab_size: int | None = None) -> WenetConfig:
        enc_type = cfg.get("encoder", "conformer")
        if enc_type != "conformer":
            raise CheckpointError(
                f"this WeNet checkpoint uses encoder {enc_type!r}; oasr-models-wenet loads "
                f"Conformer encoders (encoder: conformer)"
            )
        model_type = cfg.get("model", "asr_model")
        if model_type not in ("asr_model", None):
            raise CheckpointError(
                f"WeNet model type {model_type!r} is not supported (only asr_model: CTC + attention)"
            )
        e = dict(cfg.get("encoder_conf") or {})
        d = dict(cfg.get("decoder_conf") or {})
        m = dict(cfg.get("model_conf") or {})
        ds = dict(cfg.get("dataset_conf") or {})
        fb = dict(ds.get("fbank_conf") or {})
        for key in ("pos_enc_layer_type",):
            if e.get(key, "rel_pos") != "rel_pos":
                raise CheckpointError(
                    f"encoder_conf.{key} = {e.get(key)!r} is not supported; WeNet Conformer "
                    f"checkpoints with rel_pos are"
                )
        sel = e.get("selfattention_layer_type", "rel_selfattn")
        if sel != "rel_selfattn":
            raise CheckpointError(f"selfattention_layer_type {sel!r} is not supported (rel_selfattn is)")
        if e.get("input_layer", "conv2d") not in ("conv2d", "conv2d6", "conv2d8"):
            raise CheckpointError(
                f"input_layer {e.get('input_layer')!r} is not supported; use conv2d, conv2d6 or conv2d8"
            )
        for key in ("n_kv_head", "head_dim"):
            if e.get(key) is not None:
                raise CheckpointError(f"encoder_conf.{key} is not supported")
        if e.get("layer_norm_type", "layer_norm") != "layer_norm":
            raise CheckpointError("encoder_conf.layer_norm_type must be layer_norm")
        if e.get("mlp_type", "position_wise_feed_forward") != "position_wise_feed_forward":
            raise CheckpointError("encoder_conf.mlp_type must be position_wise_feed_forward")
        dec = cfg.get("decoder", "bitransformer")
        if dec not in ("transformer", "bitransformer"):
            raise CheckpointError(f"decoder {dec!r} is not supported (transformer or bitransformer)")
        vocab = int(cfg.get("output_dim") or vocab_size or 0)
        if vocab <= 0:
            raise CheckpointError("train.yaml has no output_dim and no unit table gives the vocabulary size")
        special = (cfg.get("tokenizer_conf") or {}).get("special_tokens") or {}
        sos = int(special.get("<sos>", vocab - 1))
        eos = int(special.get("<eos>", vocab - 1))
        sr = int((ds.get("resample_conf") or {}).get("resample_rate", 16000))
        return cls(
            input_dim=int(cfg.get("input_dim") or fb.get("num_mel_bins", 80)),
            vocab_size=vocab,
            output_size=int(e.get("output_size", 256)),
            attention_heads=int(e.get("attention_heads", 4)),
            linear_units=int(e.get("linear_units", 2048)),
            num_blocks=int(e.get("num_blocks", 6)),
            input_layer=str(e.get("input_layer", "conv2d")),
            pos_enc_layer_type="rel_pos",
            normalize_before=bool(e.get("normalize_before", True)),
            cnn_module_kernel=int(e.get("cnn_module_kernel", 15)),
            use_cnn_module=bool(e.get("use_cnn_module", True)),
            macaron_style=bool(e.get("macaron_style", True)),
            causal=bool(e.get("causal", False)),
            cnn_module_norm=str(e.get("cnn_module_norm", "batch_norm")),
            activation_type=str(e.get("activation_type", "swish")),
            static_chunk_size=int(e.get("static_chunk_size", 0)),
            use_dynamic_chunk=bool(e.get("use_dynamic_chunk", False)),
            encoder_norm_eps=float(e.get("norm_eps", 1e-5)),
            conv_norm_eps=float(e.get("conv_norm_eps", 1e-5)),
            query_bias=bool(e.get("query_bias", True)),
            key_bias=bool(e.get("key_bias", True)),
            value_bias=bool(e.get("value_bias", True)),
            conv_bias=bool(e.get("conv_bias", True)),
            mlp_bias=bool(e.get("mlp_bias", True)),
            decoder=dec,
            decoder_heads=int(d.get("attention_heads", 4)),
            decoder_linear_units=int(d.get("linear_units", 2048)),
            decoder_num_blocks=int(d.get("num_blocks", 6)),
            decoder_r_num_blocks=int(d.get("r_num_blocks", 0)) if dec == "bitransformer" else 0,
            decoder_activation=str(d.get("activation_type", "relu")),
            decoder_normalize_before=bool(d.get("normalize_before", True)),
            ctc_weight=float(m.get("ctc_weight", 0.5)),
            reverse_weight=float(m.get("reverse_weight", 0.0)),
            blank_id=int((cfg.get("ctc_conf") or {}).get("ctc_blank_id", 0)),
            sos=sos,
            eos=eos,
            sample_rate=sr,
            num_mel_bins=int(fb.get("num_mel_bins", cfg.get("input_dim") or 80)),
            frame_length_ms=float(fb.get("frame_length", 25)),
            frame_shift_ms=float(fb.get("frame_shift", 10)),
            raw=cfg,
        )


def read_yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        body = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise CheckpointError(f"{path} is not readable YAML: {exc}") from exc
    if not isinstance(body, dict):
        raise CheckpointError(f"{path} does not hold a mapping")
    return body


def read_units(path: Path) -> list[str]:
    """``token id`` per line -> list indexed by id. Gaps are filled with ``<gap{id}>``."""
    table: dict[int, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
            raise CheckpointError(f"{path}:{n}: expected 'token id', got {line!r}")
        table[int(parts[1])] = parts[0]
    if not table:
        raise CheckpointError(f"{path} is empty")
    size = max(table) + 1
    return [table.get(i, f"<gap{i}>") for i in range(size)]


def read_cmvn(path: Path) -> tuple[list[float], list[float]]:
    """(mean, inverse std) from WeNet's JSON stats (``mean_stat``/``var_stat``/``frame_num``)
    or Kaldi's text ``compute-cmvn-stats --binary=false`` output, computed as WeNet does."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read CMVN file {path}: {exc}") from exc
    if raw[:2] == b"\0B":
        raise CheckpointError(
            f"{path} is a binary Kaldi CMVN file; recompute it with "
            f"`compute-cmvn-stats --binary=false` or use WeNet's JSON stats"
        )
    text = raw.decode("utf-8", errors="replace").strip()
    if text.startswith("{"):
        try:
            stats = json.loads(text)
            means = [float(x) for x in stats["mean_stat"]]
            var = [float(x) for x in stats["var_stat"]]
            count = float(stats["frame_num"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: malformed JSON CMVN stats ({exc})") from exc
    else:
        arr = text.split()
        if len(arr) < 6 or arr[0] != "[" or arr[-1] != "]":
            raise CheckpointError(f"{path}: not a Kaldi text CMVN stats matrix")
        dim = (len(arr) - 4) // 2
        means = [float(x) for x in arr[1 : dim + 1]]
        count = float(arr[dim + 1])
        var = [float(x) for x in arr[dim + 2 : 2 * dim + 2]]
    if count <= 0 or len(means) != len(var):
        raise CheckpointError(f"{path}: inconsistent CMVN statistics")
    mean_out, istd = [], []
    for m, v in zip(means, var, strict=True):
        m = m / count
        v = v / count - m * m
        v = max(v, 1.0e-20)
        mean_out.append(m)
        istd.append(1.0 / math.sqrt(v))
    return mean_out, istd


def resolve_cmvn_file(path: Path, cfg: dict[str, Any]) -> Path | None:
    conf = cfg.get("cmvn_conf") or {}
    name = conf.get("cmvn_file") or cfg.get("cmvn_file")
    cands = []
    if name:
        p = Path(str(name))
        cands += [p if p.is_absolute() else path / p, path / p.name]
    cands += [path / "global_cmvn", path / "global_cmvn.json"]
    for c in cands:
        if c.is_file():
            return c
    return None

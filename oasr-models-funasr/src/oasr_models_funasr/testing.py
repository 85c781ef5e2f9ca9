"""Random-weight FunASR releases for tests and benchmarks.

:func:`write_release` writes a directory in FunASR's published layout (``config.yaml``,
``model.pt``, ``am.mvn``, ``tokens.json``, ``seg_dict``, ``configuration.json``) that both
``funasr.AutoModel(model=DIR)`` and OASR load. The weights come from OASR's own network, which
uses FunASR's parameter names (the training-only decoder embedding included), with the CIF
weights and output layer scaled so that random models fire a realistic number of varied tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

#: paraformer-large (about 220M parameters)
LARGE = dict(
    output_size=512,
    attention_heads=4,
    linear_units=2048,
    num_blocks=50,
    dec_blocks=16,
    dec_units=2048,
    kernel_size=11,
)
#: the SeACo no-bias class of the random releases (a token id; 8377 in paraformer-zh)
NO_BIAS = 3

TINY = dict(
    output_size=64,
    attention_heads=4,
    linear_units=128,
    num_blocks=3,
    dec_blocks=2,
    dec_units=128,
    kernel_size=11,
)


def zh_tokens(n: int = 200) -> list[str]:
    """``<blank> <s> </s>``, ``n`` common CJK characters, ``<unk>`` (FunASR's zh layout)."""
    chars = [chr(0x4E00 + 37 * i % 20900) for i in range(n)]
    return ["<blank>", "<s>", "</s>", *chars, "<unk>"]


def en_tokens(n: int = 200, seed: int = 0) -> list[str]:
    """``<blank> <s> </s>``, lower-case pieces with and without ``@@`` (paraformer-en's BPE),
    some single letters, ``<unk>``."""
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    seen = set()
    while len(out) < n:
        k = int(rng.integers(1, 5))
        p = "".join(rng.choice(list(letters), k))
        p = p + "@@" if rng.random() < 0.4 else p
        if p not in seen:
            seen.add(p)
            out.append(p)
    return ["<blank>", "<s>", "</s>", *out, "<unk>"]


def _config(
    model: str, dims: dict[str, Any], lfr_m: int, lfr_n: int, upsample_type: str = "cnn_blstm"
) -> dict[str, Any]:
    d = dims["output_size"]
    pred = "CifPredictorV3" if model in ("BiCifParaformer", "SeacoParaformer") else "CifPredictorV2"
    pconf: dict[str, Any] = {
        "idim": d,
        "threshold": 1.0,
        "l_order": 1,
        "r_order": 1,
        "tail_threshold": 0.45,
    }
    if pred == "CifPredictorV3":
        pconf.update(
            {
                "smooth_factor2": 0.25,
                "noise_threshold2": 0.01,
                "upsample_times": 3,
                "use_cif1_cnn": False,
                "upsample_type": upsample_type,
            }
        )
    raw: dict[str, Any] = {
        "model": model,
        "model_conf": {
            "ctc_weight": 0.0,
            "lsm_weight": 0.1,
            "length_normalized_loss": True,
            "predictor_weight": 1.0,
            "predictor_bias": 1,
            "sampling_ratio": 0.75,
        },
        "encoder": "SANMEncoder",
        "encoder_conf": {
            "output_size": d,
            "attention_heads": dims["attention_heads"],
            "linear_units": dims["linear_units"],
            "num_blocks": dims["num_blocks"],
            "dropout_rate": 0.1,
            "positional_dropout_rate": 0.1,
            "attention_dropout_rate": 0.1,
            "input_layer": "pe",
            "pos_enc_class": "SinusoidalPositionEncoder",
            "normalize_before": True,
            "kernel_size": dims["kernel_size"],
            "sanm_shfit": 0,
            "selfattention_layer_type": "sanm",
        },
        "decoder": "ParaformerSANMDecoder",
        "decoder_conf": {
            "attention_heads": dims["attention_heads"],
            "linear_units": dims["dec_units"],
            "num_blocks": dims["dec_blocks"],
            "dropout_rate": 0.1,
            "positional_dropout_rate": 0.1,
            "self_attention_dropout_rate": 0.1,
            "src_attention_dropout_rate": 0.1,
            "att_layer_num": dims["dec_blocks"],
            "kernel_size": dims["kernel_size"],
            "sanm_shfit": 0,
        },
        "predictor": pred,
        "predictor_conf": pconf,
        "frontend": "WavFrontend",
        "frontend_conf": {
            "fs": 16000,
            "window": "hamming",
            "n_mels": 80,
            "frame_length": 25,
            "frame_shift": 10,
            "lfr_m": lfr_m,
            "lfr_n": lfr_n,
            "dither": 0.0,
        },
        "specaug": None,
        "tokenizer": "CharTokenizer",
        "tokenizer_conf": {"unk_symbol": "<unk>", "split_with_space": True},
        "ctc_conf": {
            "dropout_rate": 0.0,
            "ctc_type": "builtin",
            "reduce": True,
            "ignore_nan_grad": True,
        },
        "normalize": None,
    }
    if model == "SeacoParaformer":
        raw["model_conf"].update(
            {
                "inner_dim": d,
                "bias_encoder_type": "lstm",
                "bias_encoder_bid": False,
                "seaco_lsm_weight": 0.1,
                "seaco_length_normalized_loss": True,
                "train_decoder": True,
                "NO_BIAS": NO_BIAS,
            }
        )
        raw["seaco_decoder"] = "ParaformerSANMDecoder"
        raw["seaco_decoder_conf"] = {
            "attention_heads": dims["attention_heads"],
            "linear_units": dims["dec_units"],
            "num_blocks": 6,
            "att_layer_num": 6,
            "dropout_rate": 0.1,
            "positional_dropout_rate": 0.1,
            "self_attention_dropout_rate": 0.1,
            "src_attention_dropout_rate": 0.1,
            "kernel_size": 21,
            "sanm_shfit": 0,
            "use_output_layer": False,
            "wo_input_layer": True,
        }
    return raw


def write_am_mvn(
    path: Path,
    dim: int,
    rng: np.random.Generator,
    stats: tuple[np.ndarray, np.ndarray] | None = None,
) -> None:
    """FunASR's ``am.mvn``: from (mean, std) of real features when given (what a recipe
    computes), else random values of the usual size."""
    if stats is not None:
        shift = (-stats[0]).astype(np.float32)
        rescale = (1.0 / np.maximum(stats[1], 1e-3)).astype(np.float32)
    else:
        shift = -(rng.normal(10.0, 2.0, dim)).astype(np.float32)
        rescale = (1.0 / rng.uniform(2.0, 5.0, dim)).astype(np.float32)
    fmt = lambda v: " ".join(f"{x:.6f}" for x in v)  # noqa: E731
    path.write_text(
        "<Nnet>\n"
        f"<Splice> {dim} {dim}\n[ 0 ]\n"
        f"<AddShift> {dim} {dim}\n<LearnRateCoef> 0 [ {fmt(shift)} ]\n"
        f"<Rescale> {dim} {dim}\n<LearnRateCoef> 0 [ {fmt(rescale)} ]\n"
        "</Nnet>\n",
        encoding="utf-8",
    )


def _feature_stats(
    audio: Sequence[np.ndarray], raw: dict[str, Any]
) -> tuple[np.ndarray, np.ndarray]:
    import torch

    from oasr.features.funasr import FunASRFbankLFR
    from oasr_models_funasr.model import frontend_spec

    fe = FunASRFbankLFR(frontend_spec(raw["frontend_conf"]))
    feats = torch.cat(
        [fe.extract(torch.from_numpy(np.asarray(a, np.float32))[None])[0][0] for a in audio]
    )
    return feats.mean(0).numpy(), feats.std(0).numpy()


def write_release(
    dst: str | Path,
    *,
    model: str = "Paraformer",
    tokens: Sequence[str] | None = None,
    dims: dict[str, Any] | None = None,
    seed: int = 0,
    lfr_m: int = 7,
    lfr_n: int = 6,
    alpha_bias: float = -0.4,
    logit_scale: float = 8.0,
    seaco_no_bias: float = 3.0,
    upsample_type: str = "cnn_blstm",
    cmvn_audio: Sequence[np.ndarray] | None = None,
) -> Path:
    """Write a random-weight release into ``dst`` (created) and return it. BiCif and SeACo
    releases use the timestamp head FunASR's released models have (``cnn_blstm``).
    ``cmvn_audio``: 16 kHz waveforms whose LFR feature statistics become ``am.mvn`` (normalised
    features make a random model's tokens far more varied)."""
    import torch
    import yaml

    from oasr_models_funasr.checkpoints import parse_config
    from oasr_models_funasr.nn import ParaformerNet

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tokens = list(tokens if tokens is not None else zh_tokens())
    dims = dict(dims or TINY)
    raw = _config(model, dims, lfr_m, lfr_n, upsample_type)
    cfg = parse_config(raw, len(tokens))
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = ParaformerNet(cfg.encoder, cfg.decoder, cfg.predictor, len(tokens), cfg.seaco)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "fsmn_block" in name:
                p.normal_(0.0, 0.1)
            elif name.endswith("norm.weight") or ".norm" in name and name.endswith(".weight"):
                p.uniform_(0.8, 1.2)
            elif name.endswith(".bias") and "norm" in name:
                p.normal_(0.0, 0.05)
        net.predictor.cif_output.weight.mul_(3.0)
        net.predictor.cif_output.bias.fill_(alpha_bias)
        if cfg.predictor.kind == "CifPredictorV3":
            net.predictor.cif_output2.weight.mul_(3.0)
            net.predictor.cif_output2.bias.fill_(0.0)
        net.decoder.output_layer.weight.mul_(logit_scale)
        # blank / sos / eos / unk rarely win, so texts are long and varied
        net.decoder.output_layer.bias[:3] -= 4.0
        net.decoder.output_layer.bias[-1] -= 4.0
        if cfg.seaco is not None:
            # the bias path keeps the decoder's choice (NO_BIAS) at most tokens, not all
            net.hotword_output_layer.bias[NO_BIAS] += seaco_no_bias
    state = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    torch.save(state, dst / "model.pt")
    with open(dst / "config.yaml", "w", encoding="utf-8") as f:
        yaml.safe_dump(raw, f, allow_unicode=True, sort_keys=False)
    (dst / "tokens.json").write_text(json.dumps(tokens, ensure_ascii=False), encoding="utf-8")
    (dst / "seg_dict").write_text(
        "".join(f"{t} {t}\n" for t in tokens if not t.startswith("<")), encoding="utf-8"
    )
    write_am_mvn(
        dst / "am.mvn", 80 * lfr_m, rng, _feature_stats(cmvn_audio, raw) if cmvn_audio else None
    )
    (dst / "configuration.json").write_text(
        json.dumps(
            {
                "framework": "pytorch",
                "task": "auto-speech-recognition",
                "model": {"type": "funasr"},
                "pipeline": {"type": "funasr-pipeline"},
                "file_path_metas": {
                    "init_param": "model.pt",
                    "config": "config.yaml",
                    "tokenizer_conf": {"token_list": "tokens.json", "seg_dict_file": "seg_dict"},
                    "frontend_conf": {"cmvn_file": "am.mvn"},
                },
            },
            indent=2,
        ),
        encoding="utf-8",
    )
    return dst

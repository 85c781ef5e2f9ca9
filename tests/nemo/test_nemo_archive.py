"""``.nemo`` archives (a tar of model_config.yaml, model_weights.ckpt and the SentencePiece
tokenizer, as NeMo's ``save_to`` writes them) built in the test from the same random weights as
the Hugging Face checkpoints, with NeMo's parameter names and config keys: they load, without
NeMo, to the same network and the same outputs; ``oasr convert`` writes the native format."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest
import torch
import yaml

from oasr.types import DecodingOptions

from .conftest import TOKENIZER, VOCAB  # noqa: TID252

pytestmark = pytest.mark.slow

# transformers' names -> NeMo's (the inverse of what the loader does), written out here
_TO_NEMO = [
    (r"^encoder\.subsampling\.layers\.", "encoder.pre_encode.conv."),
    (r"^encoder\.subsampling\.conv_in\.", "encoder.pre_encode.conv.0."),
    (r"^encoder\.subsampling\.linear\.", "encoder.pre_encode.out."),
    (r"\.self_attn\.q_proj\.", ".self_attn.linear_q."),
    (r"\.self_attn\.k_proj\.", ".self_attn.linear_k."),
    (r"\.self_attn\.v_proj\.", ".self_attn.linear_v."),
    (r"\.self_attn\.o_proj\.", ".self_attn.linear_out."),
    (r"\.self_attn\.relative_k_proj\.", ".self_attn.linear_pos."),
    (r"\.self_attn\.bias_u$", ".self_attn.pos_bias_u"),
    (r"\.self_attn\.bias_v$", ".self_attn.pos_bias_v"),
    (r"\.conv\.norm\.", ".conv.batch_norm."),
    (r"^ctc_head\.", "decoder.decoder_layers.0."),
    (r"^decoder\.embedding\.", "decoder.prediction.embed."),
    (r"^decoder\.lstm\.", "decoder.prediction.dec_rnn.lstm."),
    (r"^decoder\.decoder_projector\.", "joint.pred."),
    (r"^encoder_projector\.", "joint.enc."),
    (r"^joint\.head\.", "joint.joint_net.2."),
]


def _nemo_state(model: torch.nn.Module, nemotron: bool) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        if nemotron:  # NeMo keeps the Sequential indices Parakeet's layout also uses
            m = re.match(r"^encoder\.subsampling\.layers\.(\d+)\.(depthwise|pointwise)_conv\.(.*)$", key)
            if m:
                key = f"encoder.subsampling.layers.{2 + 3 * int(m.group(1)) + (m.group(2) == 'pointwise')}.{m.group(3)}"
        for pattern, repl in _TO_NEMO:
            key = re.sub(pattern, repl, key)
        out[key] = value.clone()
    # NeMo also stores the preprocessor's buffers
    out["preprocessor.featurizer.window"] = torch.hann_window(400)
    out["preprocessor.featurizer.fb"] = torch.zeros(1, 80, 257)
    return out


def _nemo_config(kind: str, cfg) -> dict:  # noqa: ANN001 - a transformers config
    enc = cfg.encoder_config
    encoder = {
        "_target_": "nemo.collections.asr.modules.ConformerEncoder",
        "feat_in": enc.num_mel_bins, "feat_out": -1, "n_layers": enc.num_hidden_layers,
        "d_model": enc.hidden_size, "subsampling": "dw_striding",
        "subsampling_factor": enc.subsampling_factor,
        "subsampling_conv_channels": enc.subsampling_conv_channels,
        "ff_expansion_factor": enc.intermediate_size // enc.hidden_size,
        "self_attention_model": "rel_pos", "n_heads": enc.num_attention_heads,
        "att_context_size": [-1, -1], "xscaling": True, "untie_biases": True,
        "pos_emb_max_len": 5000, "conv_kernel_size": enc.conv_kernel_size,
        "conv_norm_type": "batch_norm", "dropout": 0.1,
    }  # fmt: skip
    pre = {
        "_target_": "nemo.collections.asr.modules.AudioToMelSpectrogramPreprocessor",
        "sample_rate": 16000, "normalize": "per_feature", "window_size": 0.025,
        "window_stride": 0.01, "window": "hann", "features": enc.num_mel_bins, "n_fft": 512,
        "log": True, "frame_splicing": 1, "dither": 1e-05, "pad_to": 0, "pad_value": 0.0,
    }  # fmt: skip
    out = {"sample_rate": 16000, "preprocessor": pre, "encoder": encoder,
           "tokenizer": {"dir": None, "type": "bpe", "model_path": "nemo:3f2a_tokenizer.model",
                         "vocab_path": "nemo:3f2a_vocab.txt"}}
    if kind == "nemotron":
        left = enc.sliding_window - 1
        encoder.update(causal_downsampling=True, att_context_style="chunked_limited",
                       att_context_size=[[left, enc.default_num_lookahead_tokens], [left, 0]],
                       conv_context_size="causal", conv_norm_type="layer_norm")
        pre["normalize"] = "NA"
    if kind == "ctc":
        out["decoder"] = {"_target_": "nemo.collections.asr.modules.ConvASRDecoder",
                          "feat_in": enc.hidden_size, "num_classes": VOCAB}
        return out
    out["decoder"] = {"_target_": "nemo.collections.asr.modules.RNNTDecoder",
                      "blank_as_pad": True, "vocab_size": VOCAB,
                      "prednet": {"pred_hidden": cfg.decoder_hidden_size,
                                  "pred_rnn_layers": cfg.num_decoder_layers, "dropout": 0.2}}
    out["joint"] = {"_target_": "nemo.collections.asr.modules.RNNTJoint", "num_classes": VOCAB,
                    "jointnet": {"joint_hidden": cfg.decoder_hidden_size, "activation": "relu",
                                 "dropout": 0.2}}
    out["decoding"] = {"strategy": "greedy_batch", "greedy": {"max_symbols": 10}}
    if kind == "tdt":
        out["joint"]["num_extra_outputs"] = len(cfg.durations)
        out["model_defaults"] = {"tdt_durations": list(cfg.durations)}
        out["decoding"].update(model_type="tdt", durations=list(cfg.durations))
    return out


def write_nemo(path: Path, kind: str, model: torch.nn.Module, hybrid: bool = False) -> Path:
    """A .nemo archive of ``model``'s weights under NeMo's names (``hybrid``: with the auxiliary
    CTC head of NeMo's hybrid transducer + CTC models)."""
    buf = io.BytesIO()
    state = _nemo_state(model, kind == "nemotron")
    config = _nemo_config(kind, model.config)
    if hybrid:
        hidden = model.config.encoder_config.hidden_size
        state["ctc_decoder.decoder_layers.0.weight"] = torch.randn(VOCAB + 1, hidden, 1)
        state["ctc_decoder.decoder_layers.0.bias"] = torch.randn(VOCAB + 1)
        config["aux_ctc"] = {"ctc_loss_weight": 0.3, "decoder": {
            "_target_": "nemo.collections.asr.modules.ConvASRDecoder", "feat_in": hidden,
            "num_classes": VOCAB}}
    torch.save(state, buf)
    files = {
        "./model_config.yaml": yaml.safe_dump(config).encode(),
        "./model_weights.ckpt": buf.getvalue(),
        "./3f2a_tokenizer.model": TOKENIZER.read_bytes(),
        "./3f2a_vocab.txt": b"",
    }
    with tarfile.open(path, "w:") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.mark.parametrize("kind", ["ctc", "rnnt", "tdt", "nemotron"])
def test_nemo_archive_loads_to_the_same_model(hf_checkpoints, waves, tmp_path, kind) -> None:
    from oasr.checkpoint import convert_checkpoint, detect_format, load_model
    from oasr.types import EngineConfig
    from oasr_models_nemo.model import NemoASR

    ck = hf_checkpoints[kind]
    archive = write_nemo(tmp_path / f"{kind}.nemo", kind, ck.model)
    assert detect_format(archive) == "nemo"
    hub_like = tmp_path / "repo"  # NVIDIA's Hub repos hold just the archive
    hub_like.mkdir()
    (hub_like / archive.name).symlink_to(archive)
    assert detect_format(hub_like) == "nemo"
    from_nemo = load_model(EngineConfig(ckpt_dir=str(archive)))
    from_hf = NemoASR.from_hf(ck.path)
    assert type(from_nemo) is type(from_hf)
    # (the .nemo config also lists the streaming model's other trained lookaheads)
    same = {"extra": {}, "lookaheads": []}
    assert from_nemo.config.to_json() | same == from_hf.config.to_json() | same
    a, b = from_nemo.net.state_dict(), from_hf.net.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    expected = from_hf.transcribe(waves, DecodingOptions(word_timestamps=True))
    got = from_nemo.transcribe(waves, DecodingOptions(word_timestamps=True))
    assert [t.text for t in got] == [t.text for t in expected]
    assert any(t.text for t in got)
    # oasr convert: .nemo -> native, which reloads to the same transcripts
    arch = convert_checkpoint(archive, tmp_path / "native")
    assert arch == from_hf.config.architecture
    native = load_model(EngineConfig(ckpt_dir=str(tmp_path / "native")))
    assert [t.text for t in native.transcribe(waves, DecodingOptions())] == [t.text for t in expected]


def test_bad_archives_are_clear_errors(tmp_path) -> None:
    from oasr.errors import CheckpointError
    from oasr_models_nemo.model import NemoASR

    bad = tmp_path / "bad.nemo"
    bad.write_bytes(b"not a tar")
    with pytest.raises(CheckpointError, match="not a readable .nemo"):
        NemoASR.from_nemo(bad)
    partial = tmp_path / "partial.nemo"
    with tarfile.open(partial, "w:") as tar:
        data = b"encoder: {}\n"
        info = tarfile.TarInfo("./model_config.yaml")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(CheckpointError, match="model_weights.ckpt"):
        NemoASR.from_nemo(partial)


def test_hybrid_tdt_ctc_archive(hf_checkpoints, waves, tmp_path) -> None:
    from oasr_models_nemo.model import NemoASR

    ck = hf_checkpoints["tdt"]
    model = NemoASR.from_nemo(write_nemo(tmp_path / "hybrid.nemo", "tdt", ck.model, hybrid=True))
    assert type(model).__name__ == "ParakeetTDT"
    assert [t.text for t in model.transcribe(waves, DecodingOptions())] == \
        [t.text for t in NemoASR.from_hf(ck.path).transcribe(waves, DecodingOptions())]

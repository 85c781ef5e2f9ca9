"""NeMo / FastConformer fixtures: tiny random-weight checkpoints written by ``transformers``'
own ``ParakeetForCTC`` / ``ParakeetForRNNT`` / ``ParakeetForTDT`` / ``NemotronAsrStreamingForRNNT``
with ``save_pretrained`` (the Hugging Face layout as released), with the real Parakeet
SentencePiece tokenizer (tests/data/nemo/tokenizer.model, 8192 pieces), built once per session.

The weights are scaled so the models say varied things (not all blank): the tests assert it."""

from __future__ import annotations

import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data" / "nemo"
TOKENIZER = DATA / "tokenizer.model"
VOCAB = 8192  # pieces of the real tokenizer; the blank is the next id
BLANK = VOCAB
SR = 16000

ENCODER = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
    "subsampling_factor": 8, "subsampling_conv_channels": 8, "num_mel_bins": 80,
    "conv_kernel_size": 9, "dropout": 0.0, "layerdrop": 0.0, "activation_dropout": 0.0,
    "attention_dropout": 0.0, "dropout_positions": 0.0,
}  # fmt: skip


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    """Tiny models: one thread is fastest and immune to a busy machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


REFERENCE_CLASSES = ("ParakeetForCTC", "ParakeetForRNNT", "ParakeetForTDT",
                     "NemotronAsrStreamingForRNNT")


def reference_missing() -> str | None:
    """Why transformers' reference classes are unavailable, or None."""
    try:
        import transformers
    except ImportError:
        return "transformers is not installed"
    missing = [n for n in REFERENCE_CLASSES if not hasattr(transformers, n)]
    return f"transformers {transformers.__version__} lacks {', '.join(missing)}" if missing else None


@dataclass
class HFCheckpoint:
    kind: str  # ctc | rnnt | tdt | nemotron
    path: Path
    model: torch.nn.Module  # the transformers model (reference)
    processor: object  # its feature extractor


def randomize(model: torch.nn.Module, seed: int, *,
              head: torch.nn.Module | None = None) -> None:
    """Random weights (LayerNorm gains kept near one), random BatchNorm statistics."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name and name.endswith("weight")) and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=g))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g))
        if head is not None:
            head.weight.mul_(3.0)


def fe_for(kind: str):
    import transformers

    if kind == "nemotron":
        return transformers.NemotronAsrStreamingFeatureExtractor()
    return transformers.ParakeetFeatureExtractor()


def _center_joint(model, fe, seed: int) -> None:
    """Random encoders give nearly the same output at every frame, so one token would win
    everywhere: move the joint's bias so that its logits are centred on a calibration input
    (each frame then picks its own token), then favour blank a little."""
    rng = np.random.default_rng(seed + 100)
    wave = (rng.standard_normal(SR * 2) * 0.1).astype(np.float32)
    feats = fe([wave], sampling_rate=SR, return_tensors="pt").input_features
    with torch.no_grad():
        enc = model.get_audio_features(input_features=feats).pooler_output[0]
        dec = model.decoder(torch.tensor([[BLANK]]))[0]
        hidden = model.joint.activation(enc + dec)
        head = model.joint.head
        head.bias.copy_(-hidden.mean(0) @ head.weight.T)
        head.bias[BLANK] += 2.0


def build_hf(kind: str, path: Path, seed: int = 0) -> HFCheckpoint:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        common = {"vocab_size": VOCAB + 1, "encoder_config": dict(ENCODER)}
        if kind == "ctc":
            cfg = transformers.ParakeetCTCConfig(pad_token_id=BLANK, **common)
            model = transformers.ParakeetForCTC(cfg).eval()
            head = None
        elif kind in ("rnnt", "tdt"):
            kw = {"blank_token_id": BLANK, "pad_token_id": BLANK,
                  "decoder_start_token_id": BLANK, "decoder_hidden_size": 24,
                  "num_decoder_layers": 2, **common}
            if kind == "tdt":
                cfg = transformers.ParakeetTDTConfig(durations=[0, 1, 2, 3, 4], **kw)
                model = transformers.ParakeetForTDT(cfg).eval()
            else:
                cfg = transformers.ParakeetRNNTConfig(**kw)
                model = transformers.ParakeetForRNNT(cfg).eval()
            head = model.joint.head
        else:  # nemotron
            enc = dict(ENCODER, sliding_window=9, default_num_lookahead_tokens=2)
            cfg = transformers.NemotronAsrStreamingConfig(
                vocab_size=VOCAB + 1, blank_token_id=BLANK, pad_token_id=BLANK,
                decoder_start_token_id=BLANK, decoder_hidden_size=24, num_decoder_layers=2,
                encoder_config=enc)
            model = transformers.NemotronAsrStreamingForRNNT(cfg).eval()
            head = model.joint.head
        randomize(model, seed, head=head)
        if head is not None:
            _center_joint(model, fe_for(kind), seed)
        if kind == "ctc":
            with torch.no_grad():
                model.ctc_head.weight.mul_(3.0)
                model.ctc_head.bias[BLANK] += 4.0
        if kind == "tdt":
            with torch.no_grad():
                # transformers' TDT generate takes the argmax over token AND duration logits as
                # the token (only its frame advance splits them): keep the durations' below
                model.joint.head.bias[VOCAB + 1:] -= 50.0
        path.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(path)
        fe = fe_for(kind)
        fe.save_pretrained(path)
        if kind == "nemotron":  # what NemotronAsrStreamingProcessor.save_pretrained adds
            (path / "processor_config.json").write_text(json.dumps({
                "processor_class": "NemotronAsrStreamingProcessor", "blank_token": "<blank>",
                "supported_num_lookahead_tokens": [2, 0], "default_num_lookahead_tokens": 2}))
    shutil.copy(TOKENIZER, path / "tokenizer.model")
    return HFCheckpoint(kind, path, model, fe)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, HFCheckpoint]:
    # the reference is required (CI pins transformers 5.24); test_gpu.py skips without it
    root = tmp_path_factory.mktemp("nemo_hf")
    return {k: build_hf(k, root / k, seed=i) for i, k in
            enumerate(("ctc", "rnnt", "tdt", "nemotron"))}


@pytest.fixture(scope="session")
def waves() -> list[np.ndarray]:
    """Three inputs of different lengths (a padded batch): noise with a varying envelope."""
    rng = np.random.default_rng(7)
    out = []
    for seconds in (3.1, 2.0, 1.3):
        n = int(seconds * SR)
        env = 0.05 + 0.2 * np.abs(np.sin(np.linspace(0, 9 * seconds, n)))
        out.append((rng.standard_normal(n) * env).astype(np.float32))
    return out


@pytest.fixture
def exact_float32():
    """float32 comparisons on CUDA with TF32 off (PyTorch's cuDNN default is TF32 convolutions);
    the GPU test modules use it through ``pytest.mark.usefixtures``."""
    import torch

    old = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = old

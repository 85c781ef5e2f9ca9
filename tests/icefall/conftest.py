"""icefall fixtures: tiny random-weight Zipformer checkpoints in icefall's released layout
(``exp/pretrained.pt`` = ``{"model": state_dict}`` as icefall's export.py writes it,
``data/lang_bpe_500/tokens.txt``), built by icefall's own ``AsrModel`` (the PyPI package
``zipformer``, training-only imports faked by ``_reference.icefall_reference``) once per session.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
VOCAB = 40


def _load_reference_module():
    spec = importlib.util.spec_from_file_location("icefall_test_reference", HERE / "_reference.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("icefall_test_reference", mod)
    spec.loader.exec_module(mod)
    return mod


reference = _load_reference_module()


@pytest.fixture(autouse=True, scope="package")
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def ref():
    """icefall's modules (model, zipformer, search), imported with fakes, for the session."""
    with reference.icefall_reference() as r:
        yield r


TINY = dict(
    feature_dim=80, downsampling_factor="1,2,4", encoder_dim="32,48,40", num_encoder_layers="1,2,1",
    encoder_unmasked_dim="16,16,16", query_head_dim="8", pos_head_dim="4", value_head_dim="6",
    num_heads="2,2,4", feedforward_dim="64,96,80", cnn_module_kernel="15,7,7", pos_dim=16,
    vocab_size=VOCAB, decoder_dim=16, joiner_dim=24,
)


def tokens_table(vocab: int = VOCAB) -> list[str]:
    letters = "ABCDEFGHIJKLMNOPRSTUVWY"
    pieces = ["<blk>", "<sos/eos>", "<unk>"]
    i = 0
    while len(pieces) < vocab:
        a = letters[i % len(letters)]
        b = letters[(i * 7 + 3) % len(letters)]
        pieces.append(("\u2581" + a + b) if i % 3 == 0 else (a + b.lower()).upper())
        i += 1
    return pieces


def build_reference(ref, *, causal: bool, use_ctc: bool = True, use_transducer: bool = True, seed: int = 0,
                    blank_bias: float = 1.0, **overrides):
    """icefall's AsrModel with random weights: its own init, perturbed, and a joiner / CTC head
    that emits a mix of blanks and varied tokens."""
    torch.manual_seed(seed)
    kw = {**TINY, **overrides}
    m = ref.model.AsrModel(**kw, causal=causal, use_ctc=use_ctc, use_transducer=use_transducer,
                           chunk_size="16", left_context_frames="64").eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() <= 1 else 0.02))
        # A random encoder's output barely changes over time (its channel offsets dominate):
        # the heads read it standardised with its statistics on the test signals, so tokens
        # follow the audio (varied, with blanks) instead of one constant argmax.
        feats, lens = calibration_features()
        enc, _ = m.forward_encoder(feats, lens)
        enc = torch.cat([enc[b, : (int(n) - 7) // 4] for b, n in enumerate(lens)])
        mu, sd = enc.mean(0), enc.std(0) + 1e-3

        def standardised(linear, scale: float) -> None:
            w = torch.randn(linear.weight.shape, generator=g) * scale / sd
            linear.weight.copy_(w)
            linear.bias.copy_(-(w @ mu))

        if use_transducer:
            standardised(m.joiner.encoder_proj, 0.6)
            m.joiner.decoder_proj.weight.mul_(2.0)
            m.joiner.output_linear.weight.mul_(4.0)
            m.joiner.output_linear.bias[0] += blank_bias
        if use_ctc:
            standardised(m.ctc_output[1], 1.2)
            m.ctc_output[1].bias[0] += blank_bias
    return m


def write_release(root: Path, model: torch.nn.Module, *, tokens: list[str] | None = None) -> Path:
    """icefall's release layout: exp/pretrained.pt + data/lang_bpe_500/tokens.txt."""
    (root / "exp").mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict()}, root / "exp" / "pretrained.pt")
    lang = root / "data" / "lang_bpe_500"
    lang.mkdir(parents=True, exist_ok=True)
    pieces = tokens or tokens_table(model.vocab_size)
    (lang / "tokens.txt").write_text("".join(f"{p} {i}\n" for i, p in enumerate(pieces)))
    return root


@pytest.fixture(scope="session")
def offline_release(ref, tmp_path_factory):
    """Non-causal Zipformer with transducer + CTC heads."""
    m = build_reference(ref, causal=False, seed=1)
    return m, write_release(tmp_path_factory.mktemp("icefall_offline"), m)


@pytest.fixture(scope="session")
def causal_release(ref, tmp_path_factory):
    """Causal (streaming) Zipformer with transducer + CTC heads."""
    m = build_reference(ref, causal=True, seed=2)
    return m, write_release(tmp_path_factory.mktemp("icefall_causal"), m)


def waves(n: int = 3, seed: int = 0) -> list[np.ndarray]:
    """Noise-like signals of different lengths with some structure (bursts)."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        length = 16000 + 5300 * k + int(rng.integers(0, 800))
        t = np.arange(length) / 16000
        x = 0.05 * rng.standard_normal(length) + 0.2 * np.sin(2 * math.pi * (200 + 90 * k) * t) * (np.sin(7 * t) > 0)
        out.append(x.astype(np.float32))
    return out


#: samples per streaming step in the tests (320 ms at 16 kHz)
STEP = 5120


def run_alone(model, wave: np.ndarray, opts):
    """A stream fed ``wave`` on its own, :data:`STEP` samples per step: its hypothesis."""
    st = model.new_stream(opts)
    for i in range(0, len(wave), STEP):
        model.stream_step([st], [wave[i : i + STEP]], [i + STEP >= len(wave)])
    return st.hyp


def feed_staggered(model, states: list, ws: list[np.ndarray]) -> None:
    """Feed ``ws[k]`` to ``states[k]`` in shared steps of :data:`STEP` samples, stream ``k``
    joining ``k`` steps late: batches of 1, 2, 3 ... streams of different ages."""
    pos = [0] * len(ws)
    while any(p < len(w) for p, w in zip(pos, ws, strict=True)):
        live = [k for k, w in enumerate(ws) if pos[k] < len(w) and (pos[0] >= STEP * k or pos[k])]
        model.stream_step([states[k] for k in live], [ws[k][pos[k] : pos[k] + STEP] for k in live],
                          [pos[k] + STEP >= len(ws[k]) for k in live])  # fmt: skip
        for k in live:
            pos[k] += STEP


def calibration_features() -> tuple[torch.Tensor, torch.Tensor]:
    """icefall's decoding features of :func:`waves` (80-bin fbank, padded with log(1e-10))."""
    from oasr.features.kaldi import KaldiFbank
    from oasr.types import FeatureSpec

    fb = KaldiFbank(FeatureSpec(kind="kaldi_fbank", sample_rate=16000, num_bins=80, hop_length=160,
                                win_length=400, n_fft=512,
                                options={"snip_edges": False, "high_freq": -400.0}))  # fmt: skip
    feats, lens = fb.extract([torch.from_numpy(w) for w in waves()])
    pad = torch.arange(feats.shape[1])[None, :] >= lens[:, None]
    return feats.masked_fill(pad[:, :, None], math.log(1e-10)), lens


@pytest.fixture(scope="session")
def helpers():
    """The builders above, for test modules (conftest is not importable by name here)."""
    import types

    return types.SimpleNamespace(VOCAB=VOCAB, build_reference=build_reference, waves=waves,
                                 write_release=write_release, tokens_table=tokens_table,
                                 run_alone=run_alone, feed_staggered=feed_staggered)

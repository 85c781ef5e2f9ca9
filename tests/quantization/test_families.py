"""Random-weight parity per family: the quantized network (float32 activations, int8 / fp8
GEMMs) against a float64 copy of the same quantized network whose linears run the float64
fake-quantized reference (oasr.quantization.numerics.reference_linear).

Stated bound: max |logit error| <= 1e-2 x max |logit| (int8) and 5e-2 (fp8). One linear alone
agrees to 1e-5 (test_numerics.py); through a network the two paths differ where an activation
lands on the other side of a rounding boundary in one of them (float32 vs float64 values): that
element moves by one quantization step (1/127 of its token's maximum for int8, one e4m3 step for
fp8) and the change travels on. Whisper's 1500-frame encoder has many such elements (measured
4e-3 int8, 2.3e-2 fp8); the smaller NeMo and WeNet inputs have almost none (< 1e-6). Each test
also checks that quantization itself moves the logits more than the bound allows for the
paths' difference, so the comparison can fail."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import nemo_net, quantized_and_reference, rel_err, whisper_logits, whisper_net  # noqa: E402

from oasr.layers.quantized import QuantizedLinear  # noqa: E402

BOUND = {"int8_w8a8": 1e-2, "fp8_w8a8": 5e-2}
METHODS = ("int8_w8a8", "fp8_w8a8")


def _count(net) -> int:
    return sum(isinstance(m, QuantizedLinear) for m in net.modules())


@pytest.fixture(scope="module")
def whisper():
    return whisper_net()


@pytest.mark.parametrize("method", METHODS)
def test_whisper_parity(whisper, method):
    q, ref = quantized_and_reference(whisper, method)
    # every attention / MLP linear of both stacks, and for int8 the tied output projection
    # (test_tied.py)
    assert _count(q) == 2 * 6 + 2 * 10 + (method == "int8_w8a8")
    assert (q.decoder.output_projection is not None) == (method == "int8_w8a8")
    g = torch.Generator().manual_seed(1)
    mel = torch.randn(2, 80, 3000, generator=g)
    tokens = torch.randint(0, 96, (2, 6), generator=g)
    with torch.no_grad():
        got = whisper_logits(q, mel, tokens)
        want = whisper_logits(ref, mel.double(), tokens)
        plain = whisper_logits(whisper, mel, tokens)
    assert want.dtype is torch.float64 and got.dtype is torch.float32
    assert rel_err(got, want) < BOUND[method]
    # quantization changes the float model's logits far more than the bound: the test can fail
    assert rel_err(plain, want) > 2 * rel_err(got, want)


@pytest.fixture(scope="module")
def wenet():
    from qhelpers import REPO

    from oasr.checkpoint import load_model
    from oasr.types import EngineConfig

    return load_model(EngineConfig(ckpt_dir=str(REPO / "tests/data/wenet/u2pp_conformer")))


@pytest.mark.parametrize("method", METHODS)
def test_wenet_parity(wenet, method):
    from oasr.quantization.apply import keep_patterns

    net = wenet.net
    q, ref = quantized_and_reference(net, method, keep_patterns(wenet, net))
    assert _count(q) > 30
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 120, net.encoder.global_cmvn.mean.shape[0], generator=g)
    lengths = torch.tensor([120, 97])
    with torch.no_grad():
        enc, mask = q.encoder(feats, lengths)[:2]
        got = q.ctc_log_probs(enc)
        enc64, _ = ref.encoder(feats.double(), lengths)[:2]
        want = ref.ctc_log_probs(enc64)
        plain = net.ctc_log_probs(net.encoder(feats, lengths)[0])
    valid = torch.arange(got.shape[1])[None, :] < mask.reshape(2, -1).sum(-1, keepdim=True)
    assert rel_err(got[valid], want[valid]) < BOUND[method]
    assert rel_err(plain[valid], want[valid]) > 10 * rel_err(got[valid], want[valid])


@pytest.mark.parametrize("method", METHODS)
def test_nemo_parity(method):
    net = nemo_net()
    q, ref = quantized_and_reference(net, method, type(net).quantization_keep)
    kept = [n for n, m in q.named_modules() if type(m).__name__ == "Linear"]
    assert set(kept) == {"encoder.subsampling.linear", "ctc_head"}
    assert _count(q) == 2 * (5 + 2 + 4)  # attention 5, convolution 2, two feed-forwards 4
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(2, 200, 80, generator=g)
    lengths = torch.tensor([200, 150])
    with torch.no_grad():
        x, out_len = q.encoder(feats, lengths)
        got = q.ctc_head(x)
        x64, _ = ref.encoder(feats.double(), lengths)
        want = ref.ctc_head(x64)
        plain = net.ctc_head(net.encoder(feats, lengths)[0])
    valid = torch.arange(got.shape[1])[None, :] < out_len[:, None]
    assert rel_err(got[valid], want[valid]) < BOUND[method]
    assert rel_err(plain[valid], want[valid]) > 10 * rel_err(got[valid], want[valid])

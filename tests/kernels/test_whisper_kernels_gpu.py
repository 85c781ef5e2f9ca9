"""Whisper on CUDA with oasr-kernels: the encoder's CUDA graphs equal the eager encoder, and the
network with the kernels on matches it with them off (``pytest -m gpu tests/kernels``)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import oasr.layers as L

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _net(dtype=torch.float16, layers=4):
    from oasr_models_whisper.network import WhisperDims
    from oasr_models_whisper.nn import WhisperNet

    dims = WhisperDims(n_mels=80, n_audio_ctx=1500, n_audio_state=384, n_audio_head=6, n_audio_layer=layers,
                       n_vocab=51864, n_text_ctx=448, n_text_state=384, n_text_head=6, n_text_layer=layers)  # fmt: skip
    torch.manual_seed(0)
    net = WhisperNet(dims, device="cuda", dtype=dtype)
    with torch.no_grad():
        for p in net.parameters():
            p.normal_(0, 0.05)
    return net.eval().requires_grad_(False)


@pytest.fixture
def kernels():
    if importlib.util.find_spec("cupy") is None:
        pytest.skip("needs CuPy")
    from oasr_kernels.provider import install

    before = L.list_overrides()
    install("cuda")
    yield
    for key in L.list_overrides():
        L.unregister_override(*key)
    for key, fn in before.items():
        L.register_override(*key, fn)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_encoder_graphs_equal_eager(dtype) -> None:
    from oasr_models_whisper.encoder_graphs import EncoderGraphs

    net = _net(dtype)
    graphs = EncoderGraphs(net, buckets=(1, 4), capture_after=1)
    # a padded batch may get other GEMM / convolution algorithms than the eager batch (another
    # row count), so rows are compared exactly with the eager run of the padded batch, and
    # closely with the eager run of the batch itself
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    for n in (3, 1, 4, 3):
        mel = torch.randn(n, 80, 3000, device="cuda")
        out = graphs(mel)
        assert out.shape == (n, 1500, 384)
        padded = torch.cat([mel, mel.new_zeros(graphs.bucket(n) - n, 80, 3000)])
        torch.testing.assert_close(out, net.encode(padded)[:n], atol=0, rtol=0)
        torch.testing.assert_close(out, net.encode(mel), **tol)
    assert graphs.stats["captures"] == 2 and graphs.stats["replays"] == 4
    keep = graphs(torch.randn(1, 80, 3000, device="cuda"))
    again = keep.clone()
    graphs(torch.randn(1, 80, 3000, device="cuda"))  # a replay must not change a returned batch
    assert torch.equal(keep, again)
    big = torch.randn(5, 80, 3000, device="cuda")  # beyond the largest bucket: eager
    torch.testing.assert_close(graphs(big), net.encode(big), atol=0, rtol=0)


def test_encoder_graphs_with_kernels(kernels) -> None:
    from oasr_models_whisper.encoder_graphs import EncoderGraphs

    net = _net(torch.float16)
    mel = torch.randn(2, 80, 3000, device="cuda")
    eager = net.encode(mel)  # compiles the kernels
    graphs = EncoderGraphs(net, buckets=(2,))  # captured on the second call
    for _ in range(3):
        torch.testing.assert_close(graphs(mel), eager, atol=0, rtol=0)
    assert graphs.stats == {"captures": 1, "replays": 2, "eager": 1}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_whisper_network_kernels_on_vs_off(kernels, dtype) -> None:
    net = _net(dtype)
    mel = torch.randn(2, 80, 3000, device="cuda")
    tokens = torch.tensor([[50258, 50259, 50359, 50363], [50258, 50259, 50359, 50363]], device="cuda")

    def run():
        feats = net.encode(mel)
        cache = net.new_cache(feats)
        return feats, net.decode(tokens, cache)

    feats_k, logits_k = run()
    with L.native_ops():
        feats_n, logits_n = run()
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(feats_k.float(), feats_n.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(logits_k, logits_n, atol=tol * 5, rtol=tol)


def test_step_model_encodes_through_graphs(kernels) -> None:
    """The executor's step model encodes through the graphs, with the same result."""
    from oasr_models_whisper.engine_adapter import WhisperStepModel

    net = _net(torch.float16, layers=2)
    step = WhisperStepModel(net, encoder_graphs=True)
    assert step.encoder_graphs is not None
    mel = torch.randn(4, 80, 3000, device="cuda")  # a whole bucket: the same kernels as eager
    torch.testing.assert_close(step.encode(mel), net.encode(mel), atol=0, rtol=0)
    torch.testing.assert_close(step.encode(mel), net.encode(mel), atol=0, rtol=0)
    assert step.encoder_graphs.stats["replays"] == 1 and step.encoder_graphs.stats["eager"] == 1

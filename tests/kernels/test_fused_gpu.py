"""oasr-kernels' fused kernels and paged prefill attention against their native ops, on a GPU
(``pytest -m gpu tests/kernels``): fp32 / fp16 / bf16 parity, fallbacks, CUDA graph capture,
and autotuning into a cache file that launches then read."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

import oasr.layers as L
from oasr import tune
from oasr.layers.conformer import DepthwiseConv1d
from oasr.layers.llm import RMSNorm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# the kernels compute in fp32 like torch's; they differ by summation order and one rounding of
# the output, so a couple of ulps of the dtype
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2},
}

CONV_TOL = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 1e-2, "rtol": 1e-2},
    torch.bfloat16: {"atol": 6e-2, "rtol": 3e-2},
}


@pytest.fixture(autouse=True)
def kernels(monkeypatch):
    """The provider installed, the override table restored afterwards. Every kernel on: some
    are off by default until autotune measures a win on the running GPU (``USE_BY_DEFAULT``),
    but these tests check what each computes; no autotune cache is read."""
    from oasr_kernels import fused
    from oasr_kernels.provider import install

    monkeypatch.setenv("OASR_AUTOTUNE", "0")
    monkeypatch.setattr(fused, "USE_BY_DEFAULT", dict.fromkeys(fused.USE_BY_DEFAULT, True))

    before = L.list_overrides()
    install("cuda")
    yield
    for key in L.list_overrides():
        L.unregister_override(*key)
    for key, fn in before.items():
        L.register_override(*key, fn)


def native(fn, *args):
    with L.native_ops():
        return fn(*args)


def gen(seed=0):
    return torch.Generator(device="cuda").manual_seed(seed)


def randn(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=gen(seed)) * scale).to(dtype)


# ------------------------------------------------------------------ add_norm / rms_norm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 1280), (3, 7, 512), (4, 100)])
def test_add_layer_norm(dtype, shape) -> None:
    from oasr_kernels import fused

    d = shape[-1]
    norm = L.LayerNorm(d, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(d, dtype=dtype, seed=1))
        norm.bias.copy_(randn(d, dtype=dtype, seed=2))
    x, r = randn(*shape, dtype=dtype, seed=3, scale=3.0), randn(*shape, dtype=dtype, seed=4)
    s_ref, y_ref = native(L.add_norm, x, r, norm)
    out = fused.add_norm_cuda(x, r, norm)
    assert out is not NotImplemented
    s, y = out
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)  # the sum is rounded exactly like torch's
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    s2, y2 = L.add_norm(x, r, norm)  # the kernel where the dispatch takes it, else the native op
    taken = fused._norm_params("layer", x)["use_kernel"]
    torch.testing.assert_close(y2, y if taken else y_ref, atol=0, rtol=0)
    # no residual: the norm alone
    x_same, y_alone = fused.add_norm_cuda(x, None, norm)
    assert x_same is x
    torch.testing.assert_close(y_alone, native(norm, x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(64, 3584), (1, 128)])
def test_add_rms_norm_and_rms_norm_module(dtype, shape) -> None:
    from oasr_kernels import fused

    d = shape[-1]
    norm = RMSNorm(d, eps=1e-6, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(d, dtype=dtype, seed=1))
    x, r = randn(*shape, dtype=dtype, seed=3, scale=2.0), randn(*shape, dtype=dtype, seed=4)
    s_ref, y_ref = native(L.add_norm, x, r, norm)
    s, y = fused.add_norm_cuda(x, r, norm)
    torch.testing.assert_close(s, s_ref, atol=0, rtol=0)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    torch.testing.assert_close(norm(x), native(norm, x), **TOL[dtype])  # the rms_norm override


def test_add_norm_falls_back() -> None:
    from oasr_kernels import fused

    norm = L.LayerNorm(64, device="cuda")
    x = torch.randn(8, 128, device="cuda")[:, ::2]  # not contiguous
    assert fused.add_norm_cuda(x, None, norm) is NotImplemented
    s, y = L.add_norm(x, x, norm)  # the public op still answers (native)
    torch.testing.assert_close(y, native(L.add_norm, x, x, norm)[1])
    assert fused.add_norm_cuda(torch.randn(4, 64, device="cuda", dtype=torch.float16), None, norm) is NotImplemented
    assert fused.add_norm_cuda(torch.randn(4, 64, device="cuda"), None, torch.nn.LayerNorm(64).cuda()) is NotImplemented


# ------------------------------------------------------------------ bias_act
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("shape", [(64, 5120), (1, 33)])
def test_bias_act(dtype, act, shape) -> None:
    from oasr_kernels import fused

    x = randn(*shape, dtype=dtype, seed=1, scale=3.0)
    b = randn(shape[-1], dtype=dtype, seed=2)
    ref = native(L.bias_act, x, b, act)
    out = fused.bias_act_cuda(x, b, act)
    assert out is not NotImplemented
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(fused.bias_act_cuda(x, None, act), native(L.bias_act, x, None, act), **TOL[dtype])
    taken = tune.tuned_params("bias_act", fused.act_key(act, dtype), x.device,
                              {"use_kernel": fused.USE_BY_DEFAULT["bias_act"]}).get("use_kernel", True)  # fmt: skip
    torch.testing.assert_close(L.bias_act(x, b, act), out if taken else ref, atol=0, rtol=0)


# ------------------------------------------------------------------ glu + depthwise conv1d
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("b", "c", "t", "k", "padding"),
                         [(4, 256, 375, 15, 7), (2, 512, 100, 31, 15), (1, 64, 7, 9, 4)])  # fmt: skip
def test_glu_depthwise_conv1d(dtype, b, c, t, k, padding) -> None:
    from oasr_kernels import fused

    conv = DepthwiseConv1d(c, k, padding=padding, device="cuda", dtype=dtype)
    with torch.no_grad():
        conv.bias.copy_(randn(c, dtype=dtype, seed=5))
    x = randn(b, 2 * c, t, dtype=dtype, seed=1, scale=2.0)
    ref = native(L.glu_depthwise_conv1d, x, conv)
    out = fused.glu_depthwise_conv1d_cuda(x, conv)
    assert out is not NotImplemented and out.shape == ref.shape
    # cuDNN's convolution may sum the K taps in another order (or precision) than the kernel
    tol = CONV_TOL[dtype]
    torch.testing.assert_close(out, ref, **tol)
    conv.bias = None
    torch.testing.assert_close(fused.glu_depthwise_conv1d_cuda(x, conv), native(L.glu_depthwise_conv1d, x, conv),
                               **tol)  # fmt: skip


# ------------------------------------------------------------------ log-mel
@pytest.mark.parametrize("n_mels", [80, 128])
def test_log_mel_power_and_whisper_frontend(n_mels) -> None:
    # the native mel matmul in full fp32 (another test may have allowed TF32)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        _check_log_mel(n_mels)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def _check_log_mel(n_mels) -> None:
    from oasr.features.whisper import HOP_LENGTH, N_FFT, log_mel_spectrogram, mel_filters
    from oasr_kernels import fused

    audio = torch.randn(3, 16000 * 7, device="cuda", generator=gen(1)) * 0.1
    audio[1, :8000] = 0.0  # silence: the 1e-10 clamp
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT, device="cuda"), return_complex=True)
    filt = torch.from_numpy(mel_filters(n_mels)).cuda()
    frames = stft.shape[-1] - 1
    ref = native(L.log_mel_power, stft, filt, frames)
    out = fused.log_mel_power_cuda(stft, filt, frames)
    assert out is not NotImplemented and out.shape == ref.shape == (3, n_mels, frames)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)  # log10 of fp32 sums
    # one utterance (2-D STFT) and the whole frontend
    torch.testing.assert_close(fused.log_mel_power_cuda(stft[0], filt, frames), ref[0], atol=2e-4, rtol=1e-4)
    torch.testing.assert_close(log_mel_spectrogram(audio, n_mels), native(log_mel_spectrogram, audio, n_mels),
                               atol=1e-4, rtol=1e-4)  # fmt: skip


# ------------------------------------------------------------------ paged prefill attention
def _paged(b, h, hkv, t, d, dtype, *, bs=16, extra=0, seed=0):
    """Pools holding each row's ``extra + t`` keys in shuffled blocks; q (B, H, T, D) strided."""
    g = gen(seed)
    n = extra + t
    nb = -(-n // bs) + 1  # one block more than needed: the kernel must ignore it
    num_blocks = b * nb + 2
    k_pool = torch.randn(num_blocks, bs, hkv, d, device="cuda", generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, bs, hkv, d, device="cuda", generator=g).to(dtype)
    qkv = torch.randn(b, t, 3 * h * d, device="cuda", generator=g).to(dtype)
    q = qkv[..., : h * d].view(b, t, h, d).transpose(1, 2)
    perm = torch.randperm(num_blocks, device="cuda", generator=g)
    tables = perm[: b * nb].view(b, nb).contiguous()
    lengths = torch.full((b,), n, device="cuda", dtype=torch.long)
    return q, k_pool, v_pool, tables, lengths


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize(("b", "h", "hkv", "t", "extra"),
                         [(4, 6, 6, 5, 0), (2, 8, 2, 70, 0), (3, 4, 4, 33, 20)])  # fmt: skip
def test_paged_prefill_attention(dtype, d, b, h, hkv, t, extra) -> None:
    from oasr_kernels import prefill_attention

    args = _paged(b, h, hkv, t, d, dtype, extra=extra)
    assert prefill_attention.unsupported_reason(*args) is None
    ref = native(L.paged_prefill_attention, *args)
    out = prefill_attention.launch(*args, None)  # the kernel, whatever the dispatch rule
    assert out is not None and out.shape == (b, h, t, d)
    tol = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
           torch.bfloat16: {"atol": 1e-2, "rtol": 2e-2}}[dtype]  # fmt: skip
    torch.testing.assert_close(out, ref, **tol)
    # the public op takes the kernel for short blocks of new tokens, the native op for long ones
    via_op = L.paged_prefill_attention(*args)
    if t <= prefill_attention.MAX_TOKENS:
        torch.testing.assert_close(via_op, out, atol=0, rtol=0)
    else:
        assert prefill_attention.paged_prefill_attention_cuda(*args) is NotImplemented
        torch.testing.assert_close(via_op, ref, atol=0, rtol=0)


def test_paged_prefill_attention_rows_of_different_lengths() -> None:
    from oasr_kernels import prefill_attention

    q, kp, vp, tables, lengths = _paged(3, 4, 4, 6, 64, torch.float32, extra=40)
    lengths = torch.tensor([46, 6, 23], device="cuda")
    out = prefill_attention.paged_prefill_attention_cuda(q, kp, vp, tables, lengths, 0.3)
    torch.testing.assert_close(out, native(L.paged_prefill_attention, q, kp, vp, tables, lengths, 0.3),
                               atol=2e-5, rtol=2e-5)  # fmt: skip


def test_paged_prefill_attention_falls_back() -> None:
    from oasr_kernels import prefill_attention

    q, kp, vp, tables, lengths = _paged(2, 4, 4, 5, 80, torch.float16)  # head size 80
    assert prefill_attention.paged_prefill_attention_cuda(q, kp, vp, tables, lengths) is NotImplemented
    torch.testing.assert_close(L.paged_prefill_attention(q, kp, vp, tables, lengths),
                               native(L.paged_prefill_attention, q, kp, vp, tables, lengths))  # fmt: skip


# ------------------------------------------------------------------ graphs and autotuning
def test_fused_kernels_in_cuda_graph() -> None:
    from oasr_kernels import fused

    norm = L.LayerNorm(1280, device="cuda", dtype=torch.float16)
    x = randn(16, 1280, dtype=torch.float16, seed=1)
    r = randn(16, 1280, dtype=torch.float16, seed=2)
    b = randn(1280, dtype=torch.float16, seed=3)

    def step():
        s, y = fused.launch_add_norm("layer", x, r, norm.weight, norm.bias, norm.eps)
        return fused.launch_bias_act(y, b, "gelu") + s

    eager = step()  # compiles outside capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(randn(16, 1280, dtype=torch.float16, seed=9))
    graph.replay()
    torch.testing.assert_close(captured, step(), atol=0, rtol=0)
    assert not torch.equal(captured, eager)


def test_autotune_writes_cache_that_launches_read(tmp_path, monkeypatch) -> None:
    from oasr import tune

    path = tmp_path / "tune.json"
    monkeypatch.setenv("OASR_AUTOTUNE_CACHE", str(path))
    monkeypatch.setenv("OASR_AUTOTUNE", "1")  # the fixture turned cache reads off
    tune.clear_memory_cache()
    report = tune.autotune(ops=["add_norm", "glu_depthwise_conv1d", "paged_prefill_attention"],
                           shapes={"add_norm": [{"rows": 512, "dim": 1280}],
                                   "glu_depthwise_conv1d": [{"batch": 2, "channels": 64, "frames": 100, "kernel": 15}],
                                   "paged_prefill_attention": [{"batch": 2, "heads": 4, "tokens": 40, "head_dim": 64,
                                                                "block_size": 16}]},
                           dtypes=["float16"])  # fmt: skip
    data = json.loads(path.read_text())
    assert data["arch"].startswith("sm") and report["path"] == str(path)
    entry = data["entries"]["add_norm"]["layer:f16:d1280:few"]
    assert entry["params"]["threads"] in (64, 128, 160, 256, 512, 1024) and entry["us"] > 0
    assert "f16:k15" in data["entries"]["glu_depthwise_conv1d"]
    assert "f16:d64" in data["entries"]["paged_prefill_attention"]
    # a launch reads the winner
    from oasr_kernels import fused

    assert tune.tuned_params("add_norm", "layer:f16:d1280:few", torch.device("cuda"), {}) == entry["params"]
    # a planted value is used by the launch, and the kernel still gives the same result
    data["entries"]["add_norm"]["layer:f16:d1280:few"]["params"] = {"threads": 64}
    path.write_text(json.dumps(data))
    tune.clear_memory_cache()
    assert tune.tuned_params("add_norm", "layer:f16:d1280:few", torch.device("cuda"), {}) == {"threads": 64}
    norm = L.LayerNorm(1280, device="cuda", dtype=torch.float16)
    x = randn(8, 1280, dtype=torch.float16)
    torch.testing.assert_close(fused.add_norm_cuda(x, x, norm)[1], native(L.add_norm, x, x, norm)[1], **TOL[torch.float16])
    tune.clear_memory_cache()

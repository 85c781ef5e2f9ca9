"""The Conformer layers' fast paths (issue #23) against the paths they replace: the frames-last
Conv2d subsampling (the first convolution as a GEMM, the rest channels-last) and the eval-mode
BatchNorm folded into the depthwise convolution."""

from __future__ import annotations

import pytest
import torch

import oasr.layers as L
from oasr.layers.conformer import ConformerConvModule, Conv2dSubsampling

TOL = {torch.float64: 1e-10, torch.float32: 1e-4}


def _subsampling(rate: int, dtype: torch.dtype, device: str = "cpu", d: int = 24, feats: int = 40):
    torch.manual_seed(rate)
    return Conv2dSubsampling(feats, d, rate).to(device=device, dtype=dtype).eval()


def _native_subsampling(sub: Conv2dSubsampling, x: torch.Tensor) -> torch.Tensor:
    """The NCHW path (what ``forward`` runs off CUDA)."""
    h = x.unsqueeze(1)
    for conv in sub.conv:
        h = torch.relu(conv(h))
    b, c, t, f = h.shape
    return sub.out(h.transpose(1, 2).reshape(b, t, c * f))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("rate", [4, 6, 8])
def test_frames_last_subsampling_equals_nchw(rate, dtype) -> None:
    sub = _subsampling(rate, dtype)
    x = torch.randn(3, 61, 40, dtype=dtype)
    with torch.no_grad():
        ref = _native_subsampling(sub, x)
        fast = sub.forward_frames_last(x)
    assert fast.shape == ref.shape == (3, int(sub.output_length(61)), 24)
    torch.testing.assert_close(fast, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(sub(x), ref)  # off CUDA forward stays on the NCHW path
    # with autograd on (out= cannot take it) the same values
    torch.testing.assert_close(
        sub.forward_frames_last(x).detach(), ref, atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_frames_last_subsampling_without_biases() -> None:
    sub = _subsampling(4, torch.float64)
    for conv in sub.conv:
        conv.bias = None
    x = torch.randn(2, 33, 40, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(
            sub.forward_frames_last(x), _native_subsampling(sub, x), atol=1e-10, rtol=1e-10
        )


def test_frames_last_subsampling_only_where_it_applies() -> None:
    sub = _subsampling(4, torch.float32)
    x = torch.randn(1, 30, 40)
    assert sub._frames_last_ok(x)
    assert not sub._frames_last_ok(x[:, :2])  # shorter than the kernel: the native path's error
    with L.override("conv2d", "cpu", lambda module, x: NotImplemented):
        assert not sub._frames_last_ok(x)  # a conv2d override must see the calls


@pytest.fixture(autouse=True)
def _fold_on_cpu_too(monkeypatch):
    """The fold runs on CUDA only; here the CPU takes it too, to check it against the norm."""
    monkeypatch.setattr(ConformerConvModule, "fold_batch_norm_on", frozenset({"cpu", "cuda"}))


def _conv_module(norm: str, causal: bool, dtype: torch.dtype) -> ConformerConvModule:
    torch.manual_seed(1)
    m = ConformerConvModule(16, 7, causal=causal, norm=norm).to(dtype)
    with torch.no_grad():  # non-trivial statistics, so the fold has something to fold
        for p in m.norm.parameters():
            p.normal_()
        if norm == "batch_norm":
            m.norm.running_mean.normal_()
            m.norm.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _unfolded(m: ConformerConvModule, *args):
    m.train()  # BatchNorm1d always normalises with running statistics; training only turns off the fold
    try:
        return m(*args)
    finally:
        m.eval()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_batch_norm_fold_equals_norm(causal, dtype) -> None:
    m = _conv_module("batch_norm", causal, dtype)
    x = torch.randn(3, 20, 16, dtype=dtype)
    valid = torch.ones(3, 20, dtype=torch.bool)
    valid[1, 14:] = False
    valid[2, 5:] = False
    lengths = valid.sum(1)
    with torch.no_grad():
        y, cache = m(x, valid, None, lengths)
        ref, ref_cache = _unfolded(m, x, valid, None, lengths)
    assert m._folded_depthwise("cpu") is not None
    torch.testing.assert_close(y, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert (y[1, 14:] == 0).all() and (y[2, 5:] == 0).all()
    if causal:
        assert torch.equal(cache, ref_cache)


def test_batch_norm_fold_follows_parameter_changes() -> None:
    m = _conv_module("batch_norm", False, torch.float64)
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        first = m._folded_depthwise("cpu")
        assert m._folded_depthwise("cpu") is first  # cached
        m.norm.running_var.mul_(3.0)  # an in-place edit (as load_state_dict makes)
        assert m._folded_depthwise("cpu") is not first
        torch.testing.assert_close(m(x)[0], _unfolded(m, x)[0], atol=1e-10, rtol=1e-10)
    assert "_folded_cache" not in "".join(m.state_dict())  # nothing new in checkpoints


def test_batch_norm_fold_only_where_it_applies(monkeypatch) -> None:
    assert _conv_module("layer_norm", False, torch.float32)._folded_depthwise("cpu") is None
    m = _conv_module("batch_norm", False, torch.float32)
    assert m._folded_depthwise("cpu") is not None
    with monkeypatch.context() as mp:
        mp.setattr(ConformerConvModule, "fold_batch_norm_on", frozenset({"cuda"}))
        assert m._folded_depthwise("cpu") is None  # the default: CUDA only
    assert m.train()._folded_depthwise("cpu") is None
    m.eval()
    calls = []

    def fake(module, x):
        calls.append(x.shape)
        return NotImplemented

    with L.override("batch_norm", "cpu", fake):
        assert m._folded_depthwise("cpu") is None
        with torch.no_grad():
            m(torch.randn(1, 9, 16))
    assert len(calls) == 1  # the override still sees the norm


# ------------------------------------------------------------------ CUDA (pytest -m gpu)
GPU_TOL = {torch.float32: 2e-3, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rate", [4, 6, 8])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_subsampling_frames_last(rate, dtype) -> None:
    sub = _subsampling(rate, dtype, "cuda", d=256, feats=80)
    x = torch.randn(4, 301, 80, device="cuda", dtype=dtype)
    with torch.no_grad():
        fast = sub(x)  # CUDA: the frames-last path
        ref = _native_subsampling(sub, x)
    assert sub._frames_last_ok(x)
    torch.testing.assert_close(fast.float(), ref.float(), atol=GPU_TOL[dtype], rtol=GPU_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_batch_norm_fold(dtype) -> None:
    m = _conv_module("batch_norm", False, torch.float32).to("cuda", dtype)
    x = torch.randn(4, 200, 16, device="cuda", dtype=dtype)
    valid = torch.ones(4, 200, dtype=torch.bool, device="cuda")
    valid[3, 120:] = False
    with torch.no_grad():
        y, _ = m(x, valid)
        ref, _ = _unfolded(m, x, valid)
    torch.testing.assert_close(y.float(), ref.float(), atol=GPU_TOL[dtype], rtol=GPU_TOL[dtype])


def test_glu_depthwise_conv1d_act_native() -> None:
    from oasr.layers.conformer import DepthwiseConv1d

    conv = DepthwiseConv1d(6, 5, padding=2).double()
    x = torch.randn(2, 12, 9, dtype=torch.float64)
    plain = L.glu_depthwise_conv1d(x, conv)
    assert torch.equal(plain, conv(torch.nn.functional.glu(x, dim=1)))
    assert torch.equal(L.glu_depthwise_conv1d(x, conv, "swish"), torch.nn.functional.silu(plain))
    with pytest.raises(ValueError):
        L.glu_depthwise_conv1d(x, conv, "gelu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels,kernel,padding,act", [(256, 15, 7, "swish"), (70, 15, 7, None),
                                                         (512, 31, 15, "swish"), (64, 8, 0, "swish")])  # fmt: skip
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_glu_dwconv_frames_major_kernel(channels, kernel, padding, act, dtype) -> None:
    """oasr-kernels' frames-major GLU + depthwise (+ SiLU) kernel against the native ops, on the
    layout the Conformer module gives it: a (B, 2C, T) view of the pointwise GEMM's (B, T, 2C)."""
    fused = pytest.importorskip("oasr_kernels.fused")
    from oasr.layers.conformer import DepthwiseConv1d

    torch.manual_seed(0)
    conv = DepthwiseConv1d(channels, kernel, padding=padding).to("cuda", dtype)
    x = torch.randn(3, 203, 2 * channels, device="cuda", dtype=dtype).transpose(1, 2)
    with L.native_ops():
        ref = L.glu_depthwise_conv1d(x, conv, act)
    out = fused.launch_glu_dwconv_btc(x, conv.weight, conv.bias, padding, act is not None)
    assert out is not None, "the kernel did not run"
    assert out.shape == ref.shape and out.stride(1) == 1
    tol = GPU_TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # through the op (the override registered by the provider) the same
    torch.testing.assert_close(
        L.glu_depthwise_conv1d(x, conv, act).float(), ref.float(), atol=tol, rtol=tol
    )


def test_causal_left_context_keeps_frames_major_memory() -> None:
    """With left context the pointwise convolution still gets a (B, C, T) view of frames-major
    memory (what CUDA runs as one GEMM, then the frames-major GLU + depthwise kernel)."""
    m = _conv_module("batch_norm", True, torch.float32)
    seen = []
    m.pointwise_conv1.register_forward_pre_hook(lambda mod, args: seen.append(args[0].stride()))
    with torch.no_grad():
        m(torch.randn(2, 10, 16))
        m(torch.randn(2, 10, 16), None, torch.randn(2, 16, m.lorder))
    assert all(stride[1] == 1 for stride in seen) and len(seen) == 2

"""oasr-kernels' fused and paged prefill kernels run on the CPU through the host emulation of
CUDA (cuda_host_emulation.h), launched by the real Python launchers (their grids, shared memory
sizes and argument packing), against the native ops. Catches index, reduction, rounding and
argument-order mistakes without a GPU; the GPU tests check the real compile and launch."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

import oasr.layers as L
from oasr.layers.conformer import DepthwiseConv1d
from oasr.layers.llm import RMSNorm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _emulation import build_emulator, emulated_common, route_launches  # noqa: E402

pytestmark = pytest.mark.slow


def _translate(source: str) -> str:
    """Dynamic shared memory becomes a pointer to the emulated block's."""
    source, n1 = re.subn(r"extern __shared__ float (\w+)\[\];", r"float* \1 = reinterpret_cast<float*>(emu_dyn_smem);", source)
    source, n2 = re.subn(r"extern __shared__ long long (\w+)\[\];",
                         r"long long* \1 = reinterpret_cast<long long*>(emu_dyn_smem);", source)  # fmt: skip
    assert n1 + n2 >= 1, "emulation rule no longer matches: dynamic shared memory"
    return source


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, cxx20: str):
    from oasr_kernels import fused as fused_module

    cxx = cxx20
    work = tmp_path_factory.mktemp("emu_fused")
    csrc = Path(fused_module.__file__).parent / "csrc"
    body = emulated_common(csrc) + "\n"
    names: list[str] = []
    for filename in ("fused_ops.cu", "paged_prefill_attention.cu"):
        source = (csrc / filename).read_text()
        body += _translate(source) + "\n"
        names += re.findall(r"^OASR_\w+\((oasr_\w+),", source, flags=re.M)
        names += re.findall(r'extern "C" __global__ void (oasr_\w+)\(', source)
    assert len(names) == 24 + 12 + 3 + 3 + 1 + 6, names
    # -O0: compiles in half the time of -O1 (3 vs 5.5 s) and the whole file runs as fast
    return build_emulator(work, cxx, body, names, opt="-O0")


@pytest.fixture
def emulated(emulator, monkeypatch):
    """The launchers' MODULE.launch routed to the emulator (CPU tensors)."""
    from oasr_kernels import fused, prefill_attention

    launched = route_launches(emulator, [fused, prefill_attention], monkeypatch, max_smem=48 * 1024)
    monkeypatch.setattr(fused, "_sms", lambda device: 2)
    return launched


def native(fn, *args):
    with L.native_ops():
        return fn(*args)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: {"atol": 2e-5, "rtol": 2e-5}, torch.float16: {"atol": 4e-3, "rtol": 4e-3},
       torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [80, 75, 512])  # 16-byte vectors (1, 2 or 4 per thread), single elements
def test_emulated_add_layer_norm_and_rms_norm(emulated, dtype, d) -> None:
    from oasr_kernels import fused

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 2, d, generator=g) * 3).to(dtype)
    r = torch.randn(3, 2, d, generator=g).to(dtype)
    ln = L.LayerNorm(d, dtype=dtype)
    with torch.no_grad():
        ln.weight.copy_(torch.randn(d, generator=g))
        ln.bias.copy_(torch.randn(d, generator=g))
    s, y = fused.launch_add_norm("layer", x, r, ln.weight, ln.bias, ln.eps, {"threads": 64})
    assert ("_v" in emulated[-1]) == (d != 75)
    s_ref, y_ref = native(L.add_norm, x, r, ln)
    assert torch.equal(s, s_ref)
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    rms = RMSNorm(d, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(d, generator=g))
    s, y = fused.launch_add_norm("rms", x, r, rms.weight, None, rms.eps, {"threads": 32})
    if d == 512:
        assert emulated[-1].endswith("_v4" if dtype == torch.float32 else "_v2")
    torch.testing.assert_close(y, native(L.add_norm, x, r, rms)[1], **TOL[dtype])
    x_same, y = fused.launch_add_norm("rms", x, None, rms.weight, None, rms.eps, {"threads": 64})
    assert x_same is x
    torch.testing.assert_close(y, native(rms, x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["gelu", "silu"])
@pytest.mark.parametrize("d", [70, 48])  # single elements, 16-byte vectors
def test_emulated_bias_act(emulated, dtype, act, d) -> None:
    from oasr_kernels import fused

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(5, d, generator=g) * 3).to(dtype)
    b = torch.randn(d, generator=g).to(dtype)
    out = fused.launch_bias_act(x, b, act, {"threads": 64, "blocks_per_sm": 1})  # grid-stride: 2 blocks
    assert emulated[-1].endswith("_v") == (d == 48)
    torch.testing.assert_close(out, native(L.bias_act, x, b, act), **TOL[dtype])
    out = fused.launch_bias_act(x, None, act, {"threads": 32, "blocks_per_sm": 8})
    torch.testing.assert_close(out, native(L.bias_act, x, None, act), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("k", "padding", "t"), [(7, 3, 70), (5, 0, 9), (3, 1, 300)])
def test_emulated_glu_depthwise_conv1d(emulated, dtype, k, padding, t) -> None:
    from oasr_kernels import fused

    g = torch.Generator().manual_seed(2)
    conv = DepthwiseConv1d(6, k, padding=padding, dtype=dtype)
    with torch.no_grad():
        conv.bias.copy_(torch.randn(6, generator=g))
    x = (torch.randn(2, 12, t, generator=g) * 2).to(dtype)
    out = fused.launch_glu_dwconv(x, conv.weight, conv.bias, padding, {"threads": 32})
    ref = native(L.glu_depthwise_conv1d, x, conv)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("c", "k", "padding", "t", "act"), [(70, 7, 3, 37, "swish"), (32, 5, 0, 20, None),
                                                           (16, 15, 7, 9, "swish")])  # fmt: skip
def test_emulated_glu_depthwise_conv1d_frames_major(emulated, dtype, c, k, padding, t, act) -> None:
    """The frames-major kernel on a (B, 2C, T) view of (B, T, 2C) memory (the Conformer
    module's pointwise GEMM output), channel tiles of 32/64 with a partial last tile, 1-2 lanes."""
    from oasr_kernels import fused

    g = torch.Generator().manual_seed(4)
    conv = DepthwiseConv1d(c, k, padding=padding, dtype=dtype)
    with torch.no_grad():
        conv.bias.copy_(torch.randn(c, generator=g))
    x = (torch.randn(2, t, 2 * c, generator=g) * 2).to(dtype).transpose(1, 2)
    for params in ({"channels": 64, "lanes": 2}, {"channels": 32, "lanes": 1}):
        out = fused.launch_glu_dwconv_btc(x, conv.weight, conv.bias, padding, act is not None, params)
        assert emulated[-1].startswith("oasr_glu_dwconv_btc_")
        ref = native(L.glu_depthwise_conv1d, x, conv, act) if act else native(L.glu_depthwise_conv1d, x, conv)
        assert out.shape == ref.shape and out.stride(1) == 1
        torch.testing.assert_close(out, ref, **TOL[dtype])


def test_emulated_glu_dwconv_frames_major_tunable(emulated) -> None:
    """Every autotune candidate of the frames-major kernel computes the native op."""
    from oasr_kernels import fused

    tunable = next(t for t in fused.TUNABLES if t.variant == "btc")
    shape = {"batch": 1, "channels": 40, "frames": 30, "kernel": 15}
    torch.manual_seed(5)
    run = tunable.make(shape, torch.float32, torch.device("cpu"))
    torch.manual_seed(5)
    ref = tunable.native(shape, torch.float32, torch.device("cpu"))()
    for params in tunable.candidates(shape):
        torch.testing.assert_close(run(params), ref, **TOL[torch.float32])


def test_emulated_log_mel(emulated) -> None:
    from oasr.features.whisper import HOP_LENGTH, N_FFT, mel_filters
    from oasr_kernels import fused

    g = torch.Generator().manual_seed(3)
    audio = torch.randn(2, 6000, generator=g) * 0.1
    audio[1, :3000] = 0.0
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT), return_complex=True)
    filt = torch.from_numpy(mel_filters(80))
    frames = stft.shape[-1] - 1
    out = fused.launch_log_mel(stft, filt, frames, {"frames_per_block": 16, "threads": 64})
    ref = native(L.log_mel_power, stft, filt, frames)
    assert out.shape == ref.shape == (2, 80, frames)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=1e-4)
    one = fused.launch_log_mel(stft[1], filt, frames, {"frames_per_block": 32, "threads": 128})  # a (F, T') view
    torch.testing.assert_close(one, ref[1], atol=2e-4, rtol=1e-4)
    # both layouts: frequency or time contiguous
    other = stft.contiguous() if stft.stride(1) < stft.stride(2) else stft.transpose(1, 2).contiguous().transpose(1, 2)
    assert (other.stride(1) < other.stride(2)) != (stft.stride(1) < stft.stride(2))
    torch.testing.assert_close(fused.launch_log_mel(other, filt, frames, {"frames_per_block": 16, "threads": 64}), ref,
                               atol=2e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("d", "h", "hkv", "t", "lengths"), [(64, 2, 2, 9, (9, 30)), (128, 4, 2, 5, (5, 5)),
                                                             (64, 3, 1, 40, (40, 47))])  # fmt: skip
def test_emulated_paged_prefill_attention(emulated, dtype, d, h, hkv, t, lengths) -> None:
    from oasr_kernels import prefill_attention

    g = torch.Generator().manual_seed(d + t)
    b, bs = len(lengths), 4
    nb = -(-max(lengths) // bs) + 1
    num_blocks = b * nb + 1
    kp = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vp = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    qkv = torch.randn(b, t, 3 * h * d, generator=g).to(dtype)
    q = qkv[..., : h * d].view(b, t, h, d).transpose(1, 2)  # strided, as the step model leaves it
    tables = (torch.randperm(num_blocks - 1, generator=g) + 1)[: b * nb].view(b, nb)
    lens = torch.tensor(lengths)
    assert prefill_attention.unsupported_reason(q, kp, vp, tables, lens) == "not a CUDA tensor"
    out = prefill_attention.launch(q, kp, vp, tables, lens, None, {"warps": 2})
    ref = native(L.paged_prefill_attention, q, kp, vp, tables, lens)
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    if dtype == torch.float32:
        out = prefill_attention.launch(q, kp, vp, tables, lens, 0.3, {"warps": 1})
        torch.testing.assert_close(out, native(L.paged_prefill_attention, q, kp, vp, tables, lens, 0.3),
                                   atol=tol, rtol=tol)  # fmt: skip

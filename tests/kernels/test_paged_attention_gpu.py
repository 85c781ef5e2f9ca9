"""oasr-kernels' CUDA paged decode attention against the native op (run with
``pytest -m gpu tests/kernels`` on a machine with a GPU and CuPy)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import oasr.layers as L

sys.path.insert(0, str(Path(__file__).parent))
from _paged_reference import reference  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy"),
]

OP = "paged_decode_attention"
# fp16/bf16: the kernel and the native op each round an fp32 result once, and SDPA also rounds
# the probabilities to the input dtype; one ulp of bf16 is 7.8e-3 at 1.0, so a relative term
# is needed on top of the absolute 2e-3.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    # the native bf16 SDPA rounds its probabilities to bf16 before multiplying by V: on the
    # H200 it sat up to 2.6e-3 from the fp32-accumulating kernel (one element in 163840)
    torch.bfloat16: {"atol": 4e-3, "rtol": 1.6e-2},
}
# against the float64 reference the kernel is within its own output rounding
EXACT_TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-3, "rtol": 4e-3},
}


@pytest.fixture
def kernel():
    """The CUDA override registered (as the provider installs it), the table restored after."""
    from oasr_kernels import paged_attention
    from oasr_kernels.provider import install

    before = L.list_overrides()
    assert OP in install("cuda")
    yield paged_attention
    for key in L.list_overrides():
        L.unregister_override(*key)
    for key, fn in before.items():
        L.register_override(*key, fn)


def native(*args):
    with L.native_ops():
        return L.paged_decode_attention(*args)


def make(b, h, d, dtype, *, bs=16, nb=8, num_blocks=None, seed=0, strided_q=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = num_blocks or b * nb + 3
    kw = {"device": "cuda", "generator": g}
    k_pool = torch.randn(num_blocks, bs, h, d, **kw).to(dtype)
    v_pool = torch.randn(num_blocks, bs, h, d, **kw).to(dtype)
    if strided_q:  # q as the executor's fused QKV projection leaves it: a strided view
        qkv = torch.randn(b, 1, 3 * h * d, **kw).to(dtype)
        q = qkv[..., : h * d].view(b, 1, h, d).transpose(1, 2)
    else:
        q = torch.randn(b, h, 1, d, **kw).to(dtype)
    # every row gets distinct shuffled block ids (block 0 is the scratch block)
    perm = torch.randperm(num_blocks - 1, device="cuda", generator=g) + 1
    tables = perm[: b * nb].view(b, nb).contiguous()
    full = nb * bs
    pattern = [full, 1, full // 2 + 3, 17, full - 1, 2, bs, bs + 1]
    lengths = torch.tensor([pattern[i % len(pattern)] for i in range(b)], device="cuda")
    return q, k_pool, v_pool, tables, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("b", [1, 7, 64])
def test_kernel_matches_native(kernel, dtype, d, b) -> None:
    h = 20 if b == 64 else 6
    nb = 28 if b == 1 else 8  # 448 keys: Whisper's whole context
    args = make(b, h, d, dtype, nb=nb, strided_q=b != 7)
    assert kernel.unsupported_reason(*args) is None
    out = kernel.paged_decode_attention_cuda(*args)
    assert out is not NotImplemented
    assert out.shape == (b, h, 1, d) and out.dtype == dtype
    torch.testing.assert_close(out.double().cpu(), reference(*args), **EXACT_TOL[dtype])
    torch.testing.assert_close(out, native(*args), **TOL[dtype])
    # the public op dispatches to the kernel
    torch.testing.assert_close(L.paged_decode_attention(*args), out, atol=0, rtol=0)


def test_kernel_scale_and_full_lengths(kernel) -> None:
    q, kp, vp, tables, _ = make(5, 4, 64, torch.float32, nb=4)
    lengths = torch.full((5,), 64, device="cuda")
    out = kernel.paged_decode_attention_cuda(q, kp, vp, tables, lengths, 0.2)
    torch.testing.assert_close(out, native(q, kp, vp, tables, lengths, 0.2), **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_kernel_in_cuda_graph_with_new_tables_and_lengths(kernel, dtype) -> None:
    b, h, d, nb = 8, 4, 64, 6
    q, kp, vp, tables, lengths = make(b, h, d, dtype, nb=nb, strided_q=False)
    L.paged_decode_attention(q, kp, vp, tables, lengths)  # compiles: outside capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        L.paged_decode_attention(q, kp, vp, tables, lengths)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = L.paged_decode_attention(q, kp, vp, tables, lengths)
    assert not kernel._warned_capture and not kernel._disabled  # the kernel was captured
    for seed in (1, 2):
        q2, _, _, tables2, lengths2 = make(b, h, d, dtype, nb=nb, seed=seed, strided_q=False)
        lengths2 = lengths2.roll(seed)
        q.copy_(q2)
        tables.copy_(tables2)
        lengths.copy_(lengths2)
        kp.mul_(0.9)  # the executor writes this step's keys into the pools before attention
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, native(q, kp, vp, tables, lengths), **TOL[dtype])


def test_native_op_is_capturable_too() -> None:
    args = make(4, 2, 64, torch.float16, nb=4, strided_q=False)
    q, kp, vp, tables, lengths = args
    native(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = native(*args)
    lengths.copy_(torch.tensor([64, 1, 5, 33], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, native(*args))


def test_unsupported_inputs_fall_back(kernel) -> None:
    fn = kernel.paged_decode_attention_cuda
    q, kp, vp, tables, lengths = make(3, 2, 64, torch.float16, nb=4)

    def falls_back(*args, reason: str, run_native: bool = True) -> None:
        assert reason in kernel.unsupported_reason(*args)
        assert fn(*args) is NotImplemented
        if run_native:
            torch.testing.assert_close(L.paged_decode_attention(*args), native(*args))

    q80, kp80, vp80, t80, l80 = make(3, 2, 80, torch.float16, nb=4)
    falls_back(q80, kp80, vp80, t80, l80, reason="head size 80")
    falls_back(q, kp, vp, tables.int(), lengths, reason="int64")
    strided_pool = kp.transpose(0, 1).contiguous().transpose(0, 1)
    falls_back(q, strided_pool, vp, tables, lengths, reason="contiguous")
    falls_back(q, kp.float(), vp, tables, lengths, reason="dtypes differ", run_native=False)
    big_kp = torch.zeros(2, 8200, 2, 64, device="cuda", dtype=torch.float16)
    falls_back(q, big_kp, big_kp, tables[:, :1] % 2, lengths, reason="8192 keys")
    cpu = [t.cpu() for t in (q, kp, vp, tables, lengths)]
    assert fn(*cpu) is NotImplemented


def test_provider_installs_through_core_activation() -> None:
    from oasr import kernel_providers
    from oasr.plugins import reset_plugin_manager

    before = L.list_overrides().get((OP, "cuda"))
    reset_plugin_manager()
    kernel_providers._reset()
    try:
        assert "oasr-kernels" in L.install_kernel_providers("cuda")
        assert L.get_override(OP, "cuda") is not None
    finally:
        kernel_providers._reset()
        if before is None:
            L.unregister_override(OP, "cuda")
        else:
            L.register_override(OP, "cuda", before)


def test_timing_against_native(kernel, capsys) -> None:
    """Not a pass/fail benchmark: prints per-call times for the Whisper decode shapes."""
    rows = []
    for b, nb, length in [(1, 32, 448), (64, 8, 100), (64, 32, 448)]:
        q, kp, vp, tables, _ = make(b, 20, 64, torch.float16, nb=nb, strided_q=True)
        args = (q, kp, vp, tables, torch.full((b,), length, device="cuda"))
        times = []
        for fn in (native, kernel.paged_decode_attention_cuda):
            for _ in range(3):
                fn(*args)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(20):
                    fn(*args)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1000 / 20)
        rows.append(f"B={b:3d} H=20 D=64 fp16 keys={length:3d} (nb={nb:2d}): native {times[0]:7.1f} us"
                    f"  kernel {times[1]:6.1f} us")  # fmt: skip
    with capsys.disabled():
        print("\n" + "\n".join(rows))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("h,hkv,d", [(8, 2, 128), (14, 2, 64), (4, 1, 64)])
def test_grouped_query_heads(kernel, dtype, h, hkv, d) -> None:
    """Pools of H_kv heads (grouped-query attention, as a Qwen2 decoder's cache): query head h
    reads kv head h // (H // H_kv); the kernel takes them, equal to the native op and to the
    float64 reference over repeated heads."""
    q, kp, vp, tables, lengths = make(5, h, d, dtype, nb=6)
    kp, vp = kp[:, :, :hkv].contiguous(), vp[:, :, :hkv].contiguous()
    assert kernel.unsupported_reason(q, kp, vp, tables, lengths) is None
    out = kernel.paged_decode_attention_cuda(q, kp, vp, tables, lengths)
    rep = h // hkv
    want = reference(q, kp.repeat_interleave(rep, 2), vp.repeat_interleave(rep, 2), tables, lengths)
    torch.testing.assert_close(out.double().cpu(), want, **EXACT_TOL[dtype])
    torch.testing.assert_close(out, native(q, kp, vp, tables, lengths), **TOL[dtype])
    bad = kp[:, :, :1].expand(-1, -1, 3, -1).contiguous() if h % 3 else kp
    if h % 3:
        assert "cannot share" in kernel.unsupported_reason(q, bad, bad, tables, lengths)

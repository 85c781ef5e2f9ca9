"""fp8 speed work on the GPU (pytest -m gpu): oasr-kernels' one-launch fp8 KV quantization
(``quantize_kv_into``: the paged cache's slot scatter, the cross pools' transposed layout) and
dequantization give the same bytes, scales and values as the native ops; the kernel under CUDA
graph capture; fp8 layers' dense path for a decode step's rows (``keep_dense_weight``) against
its float64 reference, and its time against the quantization kernel + fp8 GEMM it replaces."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
from qhelpers import rel_err  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = ["float32", "float16", "bfloat16"]


def _values(shape, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda") * torch.rand(*shape[:-1], 1, generator=g, device="cuda") * 10
    flat = x.view(-1, shape[-1])
    flat[0].zero_()  # the smallest scale
    flat[1, : shape[-1] // 2] *= 1e-4  # e4m3 subnormals
    return x.to(getattr(torch, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 13])
def test_paged_scatter_matches_native(dtype, head_dim):
    pytest.importorskip("cupy")
    from oasr.layers.quantized import _quantize_kv_into_native
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    heads, slots_total = 20, 300
    x = _values((64, 1, heads, head_dim), dtype)
    slots = torch.randperm(slots_total, device="cuda")[:64]
    got_q = torch.full((slots_total, 1, heads, head_dim), 0xAB, dtype=torch.uint8, device="cuda")
    got_s = torch.full((slots_total, 1, heads), -1.0, device="cuda")
    want_q, want_s = got_q.clone(), got_s.clone()
    assert quantize_kv_into_cuda(x, got_q, got_s, slots) is None
    _quantize_kv_into_native(x, want_q, want_s, slots)
    assert torch.equal(got_s, want_s) and torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_store_matches_native(dtype):
    """(n, frames, H, D) into pool[rows] of a (rows, H, frames, D) pool through its transposed
    view: the executor's cross store, large-v3's heads and head size."""
    pytest.importorskip("cupy")
    from oasr.layers.quantized import _quantize_kv_into_native
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    n, frames, heads, d = 3, 1500, 20, 64
    x = _values((n, frames, heads * d), dtype, seed=1).view(n, frames, heads, d)
    pool = torch.full((5, heads, frames, d), 0x11, dtype=torch.uint8, device="cuda")
    scales = torch.full((5, heads, frames), -2.0, device="cuda")
    want_q, want_s = pool.clone(), scales.clone()
    rows = slice(1, 4)
    assert quantize_kv_into_cuda(x, pool[rows].transpose(1, 2), scales[rows].transpose(1, 2)) is None
    _quantize_kv_into_native(x, want_q[rows].transpose(1, 2), want_s[rows].transpose(1, 2), None)
    assert torch.equal(scales, want_s) and torch.equal(pool, want_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_matches_native(dtype):
    pytest.importorskip("cupy")
    from oasr.quantization.numerics import dequantize_kv
    from oasr_kernels.quantize_act import dequantize_kv_cuda

    codes = torch.tensor([b for b in range(256) if b not in (0x7F, 0xFF)], dtype=torch.uint8, device="cuda")
    q = codes.repeat(64 * 20 * 64 // codes.numel() + 1)[: 64 * 20 * 64].view(64, 20, 64)
    scale = torch.rand(64, 20, device="cuda") * 3 + 1e-3
    got = dequantize_kv_cuda(q, scale, getattr(torch, dtype))
    assert torch.equal(got, dequantize_kv(q, scale, getattr(torch, dtype)))


def test_cache_write_under_graph_capture():
    """PagedKVCache.write through the op in a captured graph (after one eager call, as the
    executor's prefill makes it): the replay writes what the native op writes."""
    pytest.importorskip("cupy")
    import oasr.layers as L
    from oasr.kernel_providers import install_kernel_providers
    from oasr.kv_cache import PagedKVCache

    install_kernel_providers("cuda")

    def cache():
        return PagedKVCache(num_layers=1, num_blocks=8, block_size=16, num_heads=20, head_dim=64,
                            device="cuda", dtype=torch.float16, kv_dtype="fp8")  # fmt: skip

    k, v = _values((64, 20, 64), "float16", 2), _values((64, 20, 64), "float16", 3)
    slots = torch.arange(64, device="cuda") * 2
    got, want = cache(), cache()
    got.write(0, slots, k, v)  # eager: the kernel is compiled and loaded
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got.write(0, slots, k, v)
    k.mul_(3)
    v.mul_(0.5)
    graph.replay()
    with L.native_ops():
        want.write(0, slots, k, v)
    for a, b in zip((*got.k, *got.v, *got.k_scale, *got.v_scale), (*want.k, *want.v, *want.k_scale,
                                                                    *want.v_scale), strict=True):  # fmt: skip
        assert torch.equal(a, b)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="no fp8"
)
def test_dense_decode_path_against_reference_and_its_time():
    """Large-v3's decoder shapes, 64 rows, fp16: the dense path within fp16 rounding of its
    float64 reference; in a CUDA graph its six GEMMs take less time than the quantization
    kernel + row-scaled fp8 GEMM they replace (on the H200: about 30 vs 77 us per layer)."""
    import oasr.layers as L
    from oasr.kernel_providers import install_kernel_providers
    from oasr.layers.quantized import QuantizedLinear

    install_kernel_providers("cuda")
    torch.manual_seed(0)
    shapes = [(1280, 3840), (1280, 1280), (1280, 1280), (1280, 1280), (1280, 5120), (5120, 1280)]
    layers = []
    for k, n in shapes:
        lin = L.Linear(k, n, device="cuda", dtype=torch.float16)
        torch.nn.init.normal_(lin.weight, std=0.02)
        layers.append(QuantizedLinear.from_linear(lin, "fp8_w8a8"))
    xs = [torch.randn(64, k, device="cuda", dtype=torch.float16) for k, _ in shapes]

    def run():
        return [layer(x) for layer, x in zip(layers, xs, strict=True)]

    def timed() -> float:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        for _ in range(5):
            graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / 50  # us per layer's six GEMMs

    fp8_us = timed()
    for layer in layers:
        assert layer.keep_dense_weight() > 0
    for layer, x in zip(layers, xs, strict=True):
        assert rel_err(layer(x), layer(x.double())) < 2e-3
    dense_us = timed()
    print(f"\nlarge-v3 decoder layer, 64 rows: fp8 quantize + GEMM {fp8_us:.1f} us, dense fp16 {dense_us:.1f} us")
    assert dense_us < fp8_us


def test_int8_dense_decode_path_on_cuda():
    """int8 layers keep the dense copy on CUDA too (the decode steps' W8A16: real tiny.en's GPU
    WER, docs/quantization.md): calls of up to the row limit match the float64 reference of the
    dense path (the int8 weight, unquantized activations), larger calls stay W8A8 and match
    theirs; the same layer on the CPU keeps no copy."""
    import oasr.layers as L
    from oasr.layers.quantized import QuantizedLinear

    torch.manual_seed(0)
    lin = L.Linear(1280, 5120, device="cuda", dtype=torch.float16)
    torch.nn.init.normal_(lin.weight, std=0.02)
    layer = QuantizedLinear.from_linear(lin, "int8_w8a8")
    x = torch.randn(64, 1280, device="cuda", dtype=torch.float16)
    w8a8 = layer(x)
    assert layer.keep_dense_weight(rows=64) == 1280 * 5120 * 2
    dense = layer(x)
    assert rel_err(dense, layer(x.double())) < 2e-3
    # against the unquantized layer: W8A8 adds the activations' rounding to the weight's
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()
    assert rel_err(dense, exact) < rel_err(w8a8, exact)
    big = torch.randn(65, 1280, device="cuda", dtype=torch.float16)
    assert rel_err(layer(big), layer(big.double())) < 4e-3  # 65 rows: W8A8, its own reference
    cpu = QuantizedLinear.from_linear(L.Linear(64, 48), "int8_w8a8")
    assert cpu.keep_dense_weight() == 0 and cpu.dense_weight is None

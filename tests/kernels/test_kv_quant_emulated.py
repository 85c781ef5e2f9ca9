"""oasr-kernels' fp8 KV kernels (``csrc/quantize_act.cu``: ``oasr_quantize_kv_*``,
``oasr_dequantize_kv_*``) on the CPU through the host emulation of CUDA, launched by their real
Python launchers: the same e4m3 bytes and float32 scales as the native ops
(``oasr.layers.quantized._quantize_kv_into_native``: numerics.quantize_kv then a copy or a slot
scatter), written through the destinations' strides (the paged cache's slots, the cross pools'
(rows, heads, frames, d) layout), and the same dequantized values as numerics.dequantize_kv for
every e4m3 byte. Vectorised and scalar paths, fp32 / fp16 / bf16."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow  # one host C++ build of the emulated kernels
sys.path.insert(0, str(HERE))
from _emulation import build_emulator, emulated_common, route_launches  # noqa: E402

TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NAMES = [f"oasr_{op}_{tag}" for op in ("quantize_kv", "dequantize_kv") for tag in TAGS.values()]
INTRINSICS = ("inline float __fmul_rn(float a, float b) { return a * b; }\n"
              "inline float __fdiv_rn(float a, float b) { return a / b; }\n")  # fmt: skip


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, cxx20: str):
    from oasr_kernels import quantize_act

    csrc = Path(quantize_act.__file__).parent / "csrc"
    body = emulated_common(csrc) + "\n" + INTRINSICS + (csrc / "quantize_act.cu").read_text()
    return build_emulator(tmp_path_factory.mktemp("emu_kv_quant"), cxx20, body, NAMES)


@pytest.fixture
def launched(emulator, monkeypatch):
    """The launchers' MODULE.launch routed to the emulator (CPU tensors taken as CUDA ones)."""
    from oasr_kernels import quantize_act

    names = route_launches(emulator, [quantize_act], monkeypatch)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return names


def _values(shape, dtype, seed):
    """Vectors of very different magnitudes, one all zero (the smallest scale), tiny values
    (e4m3 subnormals after scaling)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 10
    x[0, 0, 0] = 0
    x.view(-1, shape[-1])[1, : shape[-1] // 2] *= 1e-4
    return x.to(dtype)


def _native(x, q_out, s_out, index):
    """The native op as it runs on CUDA: there torch divides by the Python scalar 448 as a
    multiply by its float32 reciprocal (the CPU divides; the GPU test compares with the real
    native op). Otherwise ``_quantize_kv_into_native``'s steps."""
    from oasr.layers.quantized import _quantize_kv_into_native
    from oasr.quantization import numerics

    amax = x.float().abs().amax(dim=-1)
    scale = (amax * torch.tensor(1 / 448, dtype=torch.float32)).clamp_min(1e-12)
    q = (x.float() / scale[..., None]).to(numerics.FP8_DTYPE).view(torch.uint8)
    # the CPU's native op: the same bytes from scales at most an ulp apart
    cpu_q, cpu_s = torch.zeros_like(q), torch.zeros_like(scale)
    _quantize_kv_into_native(x, cpu_q, cpu_s, None)
    torch.testing.assert_close(cpu_s, scale, rtol=2**-23, atol=0)
    if index is None:
        q_out.copy_(q)
        s_out.copy_(scale)
    else:
        q_out.index_copy_(0, index, q)
        s_out.index_copy_(0, index, scale)


@pytest.mark.parametrize("dtype", list(TAGS))
@pytest.mark.parametrize("d", [64, 13])  # whole 16-byte vectors, or single elements
def test_paged_write_scatter_matches_native(launched, dtype, d):
    """The paged cache's write: (N, 1, H, D) into pool slots, other slots untouched."""
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    heads, slots_total = 3, 11
    x = _values((5, 1, heads, d), dtype, seed=0)
    slots = torch.tensor([7, 2, 9, 0, 4])
    want_q = torch.full((slots_total, 1, heads, d), 0xAB, dtype=torch.uint8)
    want_s = torch.full((slots_total, 1, heads), -1.0)
    got_q, got_s = want_q.clone(), want_s.clone()
    assert quantize_kv_into_cuda(x, got_q, got_s, slots) is None
    assert launched == [f"oasr_quantize_kv_{TAGS[dtype]}"]
    _native(x, want_q, want_s, slots)
    assert torch.equal(got_s, want_s)
    assert torch.equal(got_q, want_q)


@pytest.mark.parametrize("dtype", list(TAGS))
@pytest.mark.parametrize("d", [64, 40])  # 40: fp16 vectors of 5 x 8 elements (group of 8 lanes)
def test_cross_store_into_transposed_pool_matches_native(launched, dtype, d):
    """The executor's cross store: (n, frames, H, D) into pool[rows] of a (rows, H, frames, D)
    pool, through the transposed view; the rows outside ``rows`` untouched."""
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    n, frames, heads = 2, 7, 3
    x = _values((n, frames, heads * d), dtype, seed=1).view(n, frames, heads, d)
    pool = torch.full((4, heads, frames, d), 0x11, dtype=torch.uint8)
    scales = torch.full((4, heads, frames), -2.0)
    want_q, want_s = pool.clone(), scales.clone()
    rows = slice(1, 3)
    got = quantize_kv_into_cuda(x, pool[rows].transpose(1, 2), scales[rows].transpose(1, 2))
    assert got is None
    _native(x, want_q[rows].transpose(1, 2), want_s[rows].transpose(1, 2), None)
    assert launched == [f"oasr_quantize_kv_{TAGS[dtype]}"]
    assert torch.equal(scales, want_s)
    assert torch.equal(pool, want_q)


def test_misaligned_input_takes_the_scalar_path(launched):
    """An input starting one element into its storage: no 16-byte loads, the same bytes."""
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    flat = _values((1, 7, 2, 32), torch.float16, seed=2).reshape(-1)
    x = flat[1 : 1 + 3 * 2 * 32].view(3, 1, 2, 32)
    got_q, got_s = torch.zeros(3, 1, 2, 32, dtype=torch.uint8), torch.zeros(3, 1, 2)
    want_q, want_s = got_q.clone(), got_s.clone()
    assert quantize_kv_into_cuda(x, got_q, got_s) is None
    _native(x, want_q, want_s, None)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)


def test_quantize_kv_into_declines_what_it_does_not_take(launched):
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    x = torch.randn(2, 1, 2, 8, dtype=torch.float16)
    q, s = torch.zeros(2, 1, 2, 8, dtype=torch.uint8), torch.zeros(2, 1, 2)
    assert quantize_kv_into_cuda(x.double(), q, s) is NotImplemented
    assert quantize_kv_into_cuda(x, q.view(torch.int8), s) is NotImplemented
    assert quantize_kv_into_cuda(x.transpose(2, 3), q, s) is NotImplemented  # last axis strided
    assert quantize_kv_into_cuda(x, q[:1], s[:1]) is NotImplemented  # rows differ, no index
    assert quantize_kv_into_cuda(x, q, s, torch.tensor([0, 1], dtype=torch.int32)) is NotImplemented
    assert launched == []


@pytest.mark.parametrize("dtype", list(TAGS))
@pytest.mark.parametrize("d", [64, 12])
def test_dequantize_matches_native_for_every_byte(launched, dtype, d):
    from oasr.quantization.numerics import dequantize_kv
    from oasr_kernels.quantize_act import dequantize_kv_cuda

    g = torch.Generator().manual_seed(3)
    no_nan = [b for b in range(256) if b not in (0x7F, 0xFF)]
    codes = torch.tensor(no_nan, dtype=torch.uint8)
    n_vec = -(-codes.numel() // d) * 2
    q = codes.repeat(-(-n_vec * d // codes.numel()))[: n_vec * d].view(n_vec // 2, 2, d)
    scale = torch.rand(n_vec // 2, 2, generator=g) * 3 + 1e-3
    got = dequantize_kv_cuda(q, scale, dtype)
    assert launched == [f"oasr_dequantize_kv_{TAGS[dtype]}"]
    want = dequantize_kv(q, scale, dtype)
    assert got.dtype == dtype and torch.equal(got, want)


def test_paged_cache_write_through_the_op(launched):
    """PagedKVCache.write (fp8) with the kernel registered as the op's override: the pools and
    scales the native op writes on CUDA."""
    import oasr.layers as L
    import oasr.layers.quantized  # noqa: F401 - declares the op
    from oasr.kv_cache import PagedKVCache
    from oasr_kernels.quantize_act import quantize_kv_into_cuda

    def cache():
        return PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_heads=2, head_dim=16,
                            device="cpu", dtype=torch.float16, kv_dtype="fp8")  # fmt: skip

    k = _values((5, 2, 16), torch.float16, seed=4)
    v = _values((5, 2, 16), torch.float16, seed=5)
    slots = torch.tensor([3, 8, 9, 14, 1])
    native, kernel = cache(), cache()
    for pool, scales, x in ((native.k, native.k_scale, k), (native.v, native.v_scale, v)):
        _native(x.unsqueeze(1), pool[1].view(-1, 1, 2, 16), scales[1].view(-1, 1, 2), slots)
    # the cache lives on the CPU here: the kernel registered for "cpu" (tensors pass as CUDA)
    with L.override("quantize_kv_into", "cpu", quantize_kv_into_cuda):
        kernel.write(1, slots, k, v)
    assert launched == ["oasr_quantize_kv_f16"] * 2
    for a, b in zip((*native.k, *native.v, *native.k_scale, *native.v_scale),
                    (*kernel.k, *kernel.v, *kernel.k_scale, *kernel.v_scale), strict=True):  # fmt: skip
        assert torch.equal(a, b)

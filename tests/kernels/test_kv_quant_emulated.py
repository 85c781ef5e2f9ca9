"""oasr-kernels' quantization kernels (``csrc/quantize_act.cu``: the per-token activation
quantizers ``oasr_quantize_act_*`` and the fp8 KV kernels ``oasr_quantize_kv_*``,
``oasr_dequantize_kv_*``) on the CPU through the host emulation of CUDA, launched by their real
Python launchers. Activations: the bytes and scales of the native op as it runs on CUDA for every
launch plan (a warp per row with several rows per block, groups of several warps meeting in shared
memory, a thread per vector, the kernels that read rows twice, scalar rows), round-to-even ties
included (the host runs the software e4m3 conversion; the GPU test checks the hardware one). KV:
the same e4m3 bytes and float32 scales as the native ops
(``oasr.layers.quantized._quantize_kv_into_native``: numerics.quantize_kv then a copy or a slot
scatter), written through the destinations' strides (the paged cache's slots, the cross pools'
(rows, heads, frames, d) layout), and the same dequantized values as numerics.dequantize_kv for
every e4m3 byte. Vectorised and scalar paths, fp32 / fp16 / bf16."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow  # one host C++ build of the emulated kernels
sys.path.insert(0, str(HERE))
from _emulation import build_emulator, emulated_common, route_launches  # noqa: E402

sys.path.insert(0, str(HERE.parent / "quantization"))
from qact_cases import tie_rows  # noqa: E402

TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
NAMES = [f"oasr_{op}_{tag}" for op in ("quantize_kv", "dequantize_kv") for tag in TAGS.values()]
NAMES += [f"oasr_quantize_act_{fmt}_{tag}_v{v}" for fmt in ("fp8", "int8") for tag in TAGS.values()
          for v in (0, 1, 2, 3, 4, 6, 8, 12, 16)]  # fmt: skip
INTRINSICS = ("inline float __fmul_rn(float a, float b) { return a * b; }\n"
              "inline float __fdiv_rn(float a, float b) { return a / b; }\n")  # fmt: skip


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, cxx20: str):
    from oasr_kernels import quantize_act

    csrc = Path(quantize_act.__file__).parent / "csrc"
    source, n = re.subn(r"extern __shared__ float (\w+)\[\];",
                        r"float* \1 = reinterpret_cast<float*>(emu_dyn_smem);",
                        (csrc / "quantize_act.cu").read_text())  # fmt: skip
    assert n == 1, "emulation rule no longer matches: dynamic shared memory"
    body = emulated_common(csrc) + "\n" + INTRINSICS + source
    return build_emulator(tmp_path_factory.mktemp("emu_kv_quant"), cxx20, body, NAMES)


@pytest.fixture
def launched(emulator, monkeypatch):
    """The launchers' MODULE.launch routed to the emulator (CPU tensors taken as CUDA ones)."""
    from oasr_kernels import quantize_act

    names = route_launches(emulator, [quantize_act], monkeypatch, max_smem=128)
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


# ------------------------------------------------------------------ per-token activations


def _act_native(x, fmt):
    """numerics.quantize_activations as it runs on CUDA (the scale times the float32 reciprocal
    of QMAX; the CPU's op divides by it, an ulp apart at times); bytes as uint8."""
    from oasr.quantization import numerics

    amax = x.float().abs().amax(dim=1, keepdim=True)
    scale = (amax * torch.tensor(1 / numerics.qmax(fmt), dtype=torch.float32)).clamp_min(1e-12)
    scaled = x.float() / scale
    q = scaled.round().to(torch.int8) if fmt == "int8" else scaled.to(numerics.FP8_DTYPE)
    return q.view(torch.uint8), scale


def _rows(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 10
    x[0, : shape[1] // 2] *= 1e-4  # e4m3 subnormals after scaling
    if shape[0] > 2:
        x[2].zero_()  # the smallest scale
    return x.to(dtype)


def _check_act(x, fmt):
    from oasr_kernels.quantize_act import quantize_activations_cuda

    q, s = quantize_activations_cuda(x, fmt)
    want_q, want_s = _act_native(x, fmt)
    assert q.dtype == (torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q)


# (rows, K, threads that "fill the GPU", the plan: group, vectors held)
PLANS = [
    (21, 560, 1, (32, 3)),  # a warp per row, 8 rows per block, the last block 5 rows
    (21, 560, 21 * 64, (64, 2)),  # two-warp groups meeting in shared memory, spare groups
    (5, 768, 10**9, (96, 1)),  # a thread per vector, two three-warp rows per block
]


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", list(TAGS))
@pytest.mark.parametrize("rows,k,fill,want", PLANS)
def test_activation_plans_match_native(launched, monkeypatch, fmt, dtype, rows, k, fill, want):
    from oasr_kernels import quantize_act

    monkeypatch.setattr(quantize_act, "_fill_threads", lambda index: fill)
    per_vec = 16 // torch.empty(0, dtype=dtype).element_size()
    k = k // 8 * per_vec  # the same vectors a row in every dtype
    assert quantize_act.plan(rows, k // per_vec, True, fill) == want
    _check_act(_rows((rows, k), dtype, seed=rows + k), fmt)
    assert launched[0].startswith(f"oasr_quantize_act_{fmt}_{TAGS[dtype]}_v")


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", list(TAGS))
def test_activation_ties_round_to_even(launched, monkeypatch, fmt, dtype):
    """Every representable value, tie and near-tie at exact quotients: the same bytes."""
    from oasr_kernels import quantize_act

    monkeypatch.setattr(quantize_act, "_fill_threads", lambda index: 1)  # a warp per row
    _check_act(tie_rows(fmt, dtype, 256), fmt)
    held = 2 if dtype == torch.float32 else 1
    assert launched == [f"oasr_quantize_act_{fmt}_{TAGS[dtype]}_v{held}"]


@pytest.mark.parametrize("fill", [1, 10**9])
def test_activation_rows_read_twice(launched, monkeypatch, fill):
    """Rows too long for the registers (here: at most 32 threads of 2 vectors), scalar rows (K
    not a whole number of vectors, or x not 16-byte aligned): the _v0 kernels, the same bytes."""
    from oasr_kernels import quantize_act

    monkeypatch.setattr(quantize_act, "_fill_threads", lambda index: fill)
    monkeypatch.setattr(quantize_act, "_MAX_GROUP", 32)
    monkeypatch.setattr(quantize_act, "_VECS", (1, 2))
    _check_act(_rows((9, 560), torch.float16, seed=1), "fp8")  # 70 vectors a row
    monkeypatch.setattr(quantize_act, "_MAX_GROUP", 1024)
    _check_act(_rows((9, 101), torch.bfloat16, seed=2), "int8")
    flat = _rows((1, 9 * 64 + 1), torch.float16, seed=3).view(-1)
    _check_act(flat[1:].view(9, 64), "fp8")  # misaligned
    assert launched == ["oasr_quantize_act_fp8_f16_v0", "oasr_quantize_act_int8_bf16_v0",
                        "oasr_quantize_act_fp8_f16_v0"]  # fmt: skip


def test_activation_plan_for_whisper_shapes():
    """A warp per row for the encoder's 96 000-frame batches (x in registers, the GPU full), a
    thread per 16-byte vector for a 64-row decode step (its latency)."""
    from oasr_kernels.quantize_act import plan

    h200 = 132 * 2048
    assert plan(96000, 1280 // 8, True, h200) == (32, 6)
    assert plan(96000, 5120 // 8, True, h200) == (64, 12)
    assert plan(64, 1280 // 8, True, h200) == (160, 1)
    assert plan(64, 5120 // 8, True, h200) == (640, 1)
    assert plan(1, 5000, True, h200) == (512, 12)  # not 1024 threads of 6: too many registers
    assert plan(1, 40000, True, h200) == (1024, 0)  # 16 vectors a thread at most

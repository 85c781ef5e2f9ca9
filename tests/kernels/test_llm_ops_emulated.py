"""oasr-kernels' LLM kernels (``csrc/llm_ops.cu``) on the CPU through the host emulation of CUDA
(cuda_host_emulation.h), launched by their real Python launchers, against the native ops:
``rotary_qk`` equal bit for bit in float32, float16 and bfloat16 (the kernel rounds each
product and the sum as the native ops do); ``silu_mul`` within an ulp (the host's ``expf`` and
torch's CPU exp may differ in the last bit), vectorised and scalar."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import oasr.layers as L
from oasr.layers.llm import RotaryEmbedding, rotary_qk, signed_rotary_sin, silu_mul

HERE = Path(__file__).resolve().parent
# one host C++ build of the emulated kernels (10-80 s on 2 shared cores)
pytestmark = pytest.mark.slow
sys.path.insert(0, str(HERE))
from _emulation import build_emulator, emulated_common, route_launches  # noqa: E402

TAGS = ("f32", "f16", "bf16")
NAMES = [f"oasr_{op}_{tag}{v}" for op, vs in (("rotary_qk", ("", "_v")), ("silu_mul", ("", "_v"))) for tag in TAGS
         for v in vs]  # fmt: skip
# the round-to-nearest intrinsics the kernels use against FMA contraction (the host build has none)
INTRINSICS = ("inline float __fmul_rn(float a, float b) { return a * b; }\n"
              "inline float __fadd_rn(float a, float b) { return a + b; }\n"
              "inline float __fdiv_rn(float a, float b) { return a / b; }\n")  # fmt: skip


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, cxx20: str):
    from oasr_kernels import llm_ops

    csrc = Path(llm_ops.__file__).parent / "csrc"
    body = emulated_common(csrc) + "\n" + INTRINSICS + (csrc / "llm_ops.cu").read_text()
    return build_emulator(tmp_path_factory.mktemp("emu_llm_ops"), cxx20, body, NAMES)


@pytest.fixture
def launched(emulator, monkeypatch):
    """The launcher's MODULE.launch routed to the emulator (CPU tensors taken as CUDA ones)."""
    from oasr_kernels import llm_ops

    names = route_launches(emulator, [llm_ops], monkeypatch)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    return names


def _native(op, *args):
    with L.native_ops():
        return op(*args)


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one ulp of the SiLU's rounding in each dtype, carried through the product
ULP = {torch.float32: {"atol": 1e-6, "rtol": 1e-6}, torch.float16: {"atol": 1e-3, "rtol": 1e-3},
       torch.bfloat16: {"atol": 8e-3, "rtol": 8e-3}}  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_cos", [True, False])  # per-row positions, or one table broadcast
# one block per token; several, the last partial (20 pairs or 5 vectors a block)
@pytest.mark.parametrize("group", [256, 5])
# d = 16: half a whole number of 16-byte vectors (the "_v" kernel); d = 12: one pair per thread
@pytest.mark.parametrize("d", [16, 12])
def test_rotary_qk_kernel_equals_native(launched, dtype, batch_cos, group, d, monkeypatch) -> None:
    from oasr_kernels import llm_ops
    from oasr_kernels.llm_ops import rotary_qk_cuda

    monkeypatch.setattr(llm_ops, "_ROTARY_GROUP_PAIRS", 20 if group == 5 else group)
    monkeypatch.setattr(llm_ops, "_ROTARY_VEC_UNITS", group)

    g = torch.Generator().manual_seed(0)
    b, t, heads, kv = 2, 3, 4, 2
    # the fused projection's output (q, k, v side by side): q/k is a strided view of it
    qkv = (torch.randn(b, t, (heads + 2 * kv) * d, generator=g) * 4).to(dtype)
    qk = qkv[..., : (heads + kv) * d].view(b, t, heads + kv, d)
    positions = torch.tensor([[5, 6, 7], [900, 901, 902]]) if batch_cos else torch.arange(t)[None]
    cos, sin = RotaryEmbedding(d, 10000.0)(positions, dtype)
    cos, sin = cos[:, :, None], signed_rotary_sin(sin)[:, :, None]
    q, k = rotary_qk_cuda(qk, cos, sin, heads)
    vec = (d // 2) % (16 // qk.element_size()) == 0
    assert launched == [f"oasr_rotary_qk_{TAGS[DTYPES.index(dtype)]}{'_v' if vec else ''}"]
    q_ref, k_ref = _native(rotary_qk, qk, cos, sin, heads)
    assert (
        q.is_contiguous()
        and k.is_contiguous()
        and q.shape == q_ref.shape
        and k.shape == k_ref.shape
    )
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)


def test_rotary_qk_kernel_declines_what_it_does_not_take(launched) -> None:
    from oasr_kernels.llm_ops import rotary_qk_cuda

    qk = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 2, 1, 8)
    assert rotary_qk_cuda(qk, cos.double(), cos, 2) is NotImplemented  # dtypes differ
    assert rotary_qk_cuda(qk, cos, cos, 3) is NotImplemented  # no keys
    strided = qk[..., ::2], cos[..., ::2], cos[..., ::2]  # the last axis strided
    assert rotary_qk_cuda(*strided, 2) is NotImplemented
    assert launched == []


@pytest.mark.parametrize("dtype", DTYPES)
# whole 16-byte vectors (f16/bf16: 3 per row), or single elements; 4120 / 600: several column
# chunks per row (a block per 256 vectors or 256 elements), the last one partial
@pytest.mark.parametrize("hidden", [24, 13, 4120, 600])
def test_silu_mul_kernel_matches_native(launched, dtype, hidden) -> None:
    from oasr_kernels.llm_ops import silu_mul_cuda

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 3, 2 * hidden, generator=g) * 4).to(dtype)
    got = silu_mul_cuda(x, hidden)
    vec = hidden % (16 // x.element_size()) == 0
    assert launched == [f"oasr_silu_mul_{TAGS[DTYPES.index(dtype)]}{'_v' if vec else ''}"]
    want = _native(silu_mul, x, hidden)
    assert got.shape == want.shape == (2, 3, hidden)
    torch.testing.assert_close(got, want, **ULP[dtype])
    assert silu_mul_cuda(x[..., 1:], hidden) is NotImplemented  # not contiguous / not 2 * hidden

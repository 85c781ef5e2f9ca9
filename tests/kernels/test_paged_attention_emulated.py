"""The CUDA paged decode attention source, run on the CPU through a host emulation of the few CUDA
features it uses (cuda_host_emulation.h), with the launcher's real arguments, grid and shared
memory size (``launch_config``). Catches index, reduction and argument-order mistakes without a
GPU; the GPU tests (test_paged_attention_gpu.py) check the real compile and launch."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oasr_kernels import paged_attention

sys.path.insert(0, str(Path(__file__).parent))
from _emulation import emulated_common  # noqa: E402
from _paged_reference import reference  # noqa: E402

HERE = Path(__file__).resolve().parent
SOURCE = Path(paged_attention.__file__).parent / "csrc" / "paged_decode_attention.cu"
KERNELS = [f"oasr_paged_decode_attention_{t}_d{d}" for t in ("f32", "f16", "bf16") for d in (64, 128)]
PARAMS = (
    "const void* q, long long sb, long long sh, const void* k, const void* v, "
    "const long long* tables, const long long* lengths, void* out, int h, int hkv, int nb, int bs, "
    "float scale"
)
ARGS = "q, sb, sh, k, v, tables, lengths, out, h, hkv, nb, bs, scale"


def _translate(source: str) -> str:
    """The two PTX conversions become _Float16 casts; dynamic shared memory becomes a pointer."""
    rules = [
        (r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(f\) : "h"\(h\)\);', "f = (float)std::bit_cast<_Float16>(h);"),
        (r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(h\) : "f"\(f\)\);', "h = std::bit_cast<unsigned short>((_Float16)f);"),
        (r"extern __shared__ long long oasr_pda_smem\[\];", "long long* oasr_pda_smem;"),
    ]  # fmt: skip
    for pattern, replacement in rules:
        source, n = re.subn(pattern, replacement, source)
        assert n == 1, f"emulation rule no longer matches the kernel source: {pattern}"
    return source


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory, cxx20: str):
    cxx = cxx20
    work = tmp_path_factory.mktemp("emu")
    table = ",\n".join(
        f'{{"{name}", [](const char*, {PARAMS}, unsigned gx, unsigned gy, unsigned t, unsigned m) '
        f"{{ emu_launch(gx, gy, t, m, oasr_pda_smem, [=] {{ {name}({ARGS}); }}); }}}}"
        for name in KERNELS
    )
    launcher = f"""
extern "C" int launch(const char* name, unsigned gx, unsigned gy, unsigned threads,
                      unsigned smem, {PARAMS}) {{
  struct Entry {{ const char* n; void (*run)(const char*, {PARAMS}, unsigned, unsigned, unsigned, unsigned); }};
  static const Entry entries[] = {{ {table} }};
  for (const Entry& e : entries)
    if (std::strcmp(e.n, name) == 0) {{
      e.run(name, {ARGS}, gx, gy, threads, smem);
      return 0;
    }}
  return 1;
}}
"""
    cpp = work / "emulated.cpp"
    cpp.write_text(
        f'#include "{HERE / "cuda_host_emulation.h"}"\n'
        + emulated_common(SOURCE.parent)  # the JIT prepends it too
        + "\n"
        + _translate(SOURCE.read_text())
        + launcher
    )
    lib = work / "libemulated.so"
    proc = subprocess.run([cxx, "-std=c++20", "-O1", "-shared", "-fPIC", "-Wno-unknown-pragmas",
                           "-o", str(lib), str(cpp), "-lpthread"], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    dll = ctypes.CDLL(str(lib))
    dll.launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 4 + [
        ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_float,
    ]  # fmt: skip
    return dll


def run_emulated(dll, q, k_pool, v_pool, tables, lengths, scale=None) -> torch.Tensor:
    b, h, _, d = q.shape
    out = torch.empty(b, h, 1, d, dtype=q.dtype)
    q = q if q.stride(-1) == 1 else q.contiguous()
    name, grid, block, args, smem = paged_attention.launch_config(
        q, k_pool, v_pool, tables.contiguous(), lengths.contiguous(), out, scale
    )
    assert len(grid) == 2 and len(block) == 1
    values = [float(a) if isinstance(a.item(), float) else int(a) for a in args]
    assert dll.launch(name.encode(), grid[0], grid[1], block[0], smem, *values) == 0
    return out


# half an ulp of the output plus fp32 accumulation
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 4e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs,nb", [(16, 9), (1, 40)])
def test_emulated_kernel_matches_reference(emulator, dtype, d, bs, nb) -> None:
    g = torch.Generator().manual_seed(d + nb)
    b, h, num_blocks = 3, 2, 2 + 3 * nb
    k_pool = torch.randn(num_blocks, bs, h, d, generator=g).to(dtype)
    v_pool = torch.randn(num_blocks, bs, h, d, generator=g).to(dtype)
    qkv = torch.randn(b, 1, 3 * h * d, generator=g).to(dtype)  # q as a strided view
    q = qkv[..., h * d : 2 * h * d].view(b, 1, h, d).transpose(1, 2)
    tables = (torch.randperm(num_blocks - 1, generator=g)[: b * nb] + 1).view(b, nb)
    lengths = torch.tensor([nb * bs, 1, nb * bs // 2 + 3])
    out = run_emulated(emulator, q, k_pool, v_pool, tables, lengths)
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, lengths), atol=tol, rtol=tol)


def test_emulated_kernel_scale_and_non_unit_q_stride(emulator) -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 2, 1, 128, generator=g).repeat_interleave(2, -1)[..., ::2]
    assert q.stride(-1) == 2
    k_pool, v_pool = torch.randn(2, 10, 16, 2, 128, generator=g)
    tables, lengths = torch.tensor([[3, 1], [9, 9]]), torch.tensor([20, 32])
    out = run_emulated(emulator, q, k_pool, v_pool, tables, lengths, 0.37)
    torch.testing.assert_close(out.double(), reference(q, k_pool, v_pool, tables, lengths, 0.37), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h,hkv", [(4, 2), (6, 1)])
def test_emulated_kernel_grouped_query_heads(emulator, dtype, h, hkv) -> None:
    """Pools of H_kv heads: query head h reads kv head h // (H // H_kv), as repeat_kv does."""
    g = torch.Generator().manual_seed(h * 10 + hkv)
    d, bs, nb, b = 64, 16, 3, 3
    k_pool = torch.randn(12, bs, hkv, d, generator=g).to(dtype)
    v_pool = torch.randn(12, bs, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, h, 1, d, generator=g).to(dtype)
    tables = (torch.randperm(11, generator=g)[: b * nb] + 1).view(b, nb)
    lengths = torch.tensor([nb * bs, 1, 21])
    out = run_emulated(emulator, q, k_pool, v_pool, tables, lengths)
    rep = h // hkv
    want = reference(q, k_pool.repeat_interleave(rep, 2), v_pool.repeat_interleave(rep, 2), tables, lengths)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])

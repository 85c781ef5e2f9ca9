"""Shared by the host-emulated kernel tests: ``csrc/common.cuh`` made compilable by a host C++20
compiler with ``cuda_host_emulation.h`` (its two PTX half-precision conversions become _Float16
casts), as the JIT prepends it to every kernel source; the emulator's build and the launchers
routed to it."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def emulated_common(csrc: Path) -> str:
    source = (csrc / "common.cuh").read_text()
    rules = [
        (r'asm\("cvt\.f32\.f16 %0, %1;" : "=f"\(f\) : "h"\(v\.bits\)\);', "f = (float)std::bit_cast<_Float16>(v.bits);"),
        (r'asm\("cvt\.rn\.f16\.f32 %0, %1;" : "=h"\(r\.bits\) : "f"\(f\)\);', "r.bits = std::bit_cast<unsigned short>((_Float16)f);"),
    ]  # fmt: skip
    for pattern, replacement in rules:
        source, n = re.subn(pattern, replacement, source)
        assert n == 1, f"emulation rule no longer matches common.cuh: {pattern}"
    return source


def build_emulator(work: Path, cxx: str, body: str, names: list[str], opt: str = "-O1") -> ctypes.CDLL:
    """``body`` (``emulated_common`` and kernel sources) compiled by the host C++20 compiler with a
    launcher of the kernels ``names``: ``launch(name, gx, gy, gz, threads, smem, args)`` runs one
    grid through ``cuda_host_emulation.h`` (``args`` as cuLaunchKernel takes them)."""
    table = ",\n".join(f'{{"{n}", [](void** a) {{ emu_call({n}, a); }}}}' for n in names)
    launcher = f"""
extern "C" int launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned threads,
                      unsigned smem, void** args) {{
  struct Entry {{ const char* n; void (*run)(void**); }};
  static const Entry entries[] = {{ {table} }};
  for (const Entry& e : entries)
    if (std::strcmp(e.n, name) == 0) {{
      auto run = e.run;
      emu_launch3(gx, gy, gz, threads, smem, [=] {{ run(args); }});
      return 0;
    }}
  return 1;
}}
"""
    cpp = work / "emulated.cpp"
    cpp.write_text(f'#include "{HERE / "cuda_host_emulation.h"}"\n' + body + launcher)
    lib = work / "libemulated.so"
    proc = subprocess.run([cxx, "-std=c++20", opt, "-shared", "-fPIC", "-Wno-unknown-pragmas", "-w",
                           "-o", str(lib), str(cpp), "-lpthread"], capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    dll = ctypes.CDLL(str(lib))
    dll.launch.argtypes = [ctypes.c_char_p] + [ctypes.c_uint] * 5 + [ctypes.c_void_p]
    return dll


def route_launches(emulator: ctypes.CDLL, modules: list, monkeypatch, max_smem: int = 0) -> list[str]:
    """Each launcher module's ``MODULE.launch`` replaced by a run on ``emulator`` (CPU tensors
    passed as the device pointers); returns the list the launched kernels' names are added to."""
    launched: list[str] = []

    def launch(name, grid, block, args, device, shared_mem=0):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        values = [np.array(a) for a in args]  # alive during the call
        assert all(v.dtype.itemsize in (4, 8) for v in values)
        assert shared_mem <= max_smem and block[0] % 32 == 0 and block[0] <= 1024
        argv = (ctypes.c_void_p * len(values))(*[v.ctypes.data for v in values])
        assert emulator.launch(name.encode(), *grid, block[0], shared_mem, argv) == 0, name
        launched.append(name)
        return True

    for module in modules:
        monkeypatch.setattr(module.MODULE, "launch", launch)
    return launched

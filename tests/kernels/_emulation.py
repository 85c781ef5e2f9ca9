"""Shared by the host-emulated kernel tests: ``csrc/common.cuh`` made compilable by a host C++20
compiler with ``cuda_host_emulation.h`` (its two PTX half-precision conversions become _Float16
casts), as the JIT prepends it to every kernel source."""

from __future__ import annotations

import re
from pathlib import Path


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

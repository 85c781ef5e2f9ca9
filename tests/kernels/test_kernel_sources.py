"""Every CUDA source reaches NVRTC with ``csrc/common.cuh`` in front of it.

The sources call shared device functions (``oasr::block_softmax_numerators``, ``oasr::warp_sum``)
that only common.cuh defines, and NVRTC has no include path. A launcher that reads its ``.cu``
file by itself compiles nothing on the GPU, and the host-emulated tests, which prepend common.cuh
themselves, cannot notice: this happened to the paged decode attention kernel once.
"""

from __future__ import annotations

import ast
from pathlib import Path

import oasr_kernels
from oasr_kernels import jit, paged_attention

PACKAGE = Path(oasr_kernels.__file__).parent


def test_paged_attention_source_has_common_header() -> None:
    assert paged_attention._source() == jit.read_source("paged_decode_attention.cu")


def test_only_jit_reads_kernel_sources() -> None:
    readers = []
    for module in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(module.read_text())
        for node in ast.walk(tree):
            # a path into csrc read directly, not a file name handed to jit
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and "csrc/" in node.value
                and node.value.endswith(".cu")
            ):
                readers.append(f"{module.name}: {node.value}")
    assert readers == [], readers

"""Inputs for the per-token activation quantizer's tests (the emulated kernel in
tests/kernels/test_kv_quant_emulated.py, the CUDA kernel in test_fused_quant_gpu.py): rows whose
quotients land exactly on every rounding case."""

from __future__ import annotations

import torch


def tie_rows(fmt: str, dtype: torch.dtype, width: int) -> torch.Tensor:
    """Rows whose scale is a power of two (max |x| = QMAX * 2^j, j = 0, -3, 4: 448 * fl(1/448) is
    exactly 1), so x / scale is exactly the value aimed at: each format's representable values, the
    midpoints between neighbours (ties, to even) and, in float32, the floats either side of each
    midpoint and float32 subnormals; e4m3's subnormals and the ties below them, values near QMAX."""
    from oasr.quantization import numerics

    if fmt == "fp8":
        grid = torch.arange(0, 256, dtype=torch.uint8)
        grid = grid[(grid & 0x7F) < 0x7F].view(numerics.FP8_DTYPE).float()  # no NaN codes
        pos = grid[grid >= 0].unique()
    else:
        pos = torch.arange(0, 128, dtype=torch.float32)
    mids = (pos[1:] + pos[:-1]) / 2  # exact in float32
    values = [pos, mids]
    if dtype == torch.float32:
        values += [torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)]
        values.append(torch.tensor([1e-40, 2**-149, 2**-126]))  # float32 subnormal quotients: 0
    v = torch.cat(values)
    v = torch.cat([v, -v])
    qmax = numerics.qmax(fmt)
    rows = []
    for j in (0, -3, 4):
        row = torch.cat([v, torch.tensor([qmax])])
        row = row[torch.randperm(row.numel(), generator=torch.Generator().manual_seed(j + 9))]
        row = torch.nn.functional.pad(row, (0, -(-row.numel() // width) * width - row.numel()))
        rows.append((row * 2.0**j).view(-1, width))
        rows[-1][:, 0] = qmax * 2.0**j  # every row's maximum: its scale is 2^j
    x = torch.cat(rows)
    assert torch.equal(x.to(dtype).float(), x), "a value not exact in the input dtype"
    return x.to(dtype)

"""fp8 GEMMs at decode-step shapes beside the fp16 linear, timed inside CUDA graphs.

    python -m benchmarks.fp8_gemm_small_m --json out.json     # a GPU with fp8 (SM89+)

A decode step runs its linears with few rows (the batch) inside a captured graph, where a
kernel's own duration is what counts, not its launch. For each (rows, K, N) of Whisper large-v3's
decoder this captures 50 calls of one variant in a graph, replays it 20 times and reports the
microseconds per call, with the relative error against a float32 product where the variant's
scales make one comparable. The variants are torch's fp8 GEMM (``torch._scaled_mm``) with
row-wise scales (what ``QuantizedLinear`` uses), with a bias in its epilogue, with fast
accumulation, with the operands swapped (``W @ x^T``), and with tensor-wise scales. These
figures chose the fp16 path for the decoder's small-row fp8 linears (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

#: (K, N) of large-v3's decoder linears: fused q/k/v, the attention outputs, fc1, fc2
SHAPES = ((1280, 3840), (1280, 1280), (1280, 5120), (5120, 1280))
E4M3_MAX = 448.0


def _per_row_fp8(t):  # (rows, K) -> e4m3 values and their (rows, 1) float32 scales
    import torch

    scale = t.abs().amax(1, keepdim=True).float() / E4M3_MAX
    return (t / scale).to(torch.float8_e4m3fn), scale


def _graph_us(fn: Callable[[], object], calls: int = 50, replays: int = 20) -> float:
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def measure(rows: int, k: int, n: int) -> dict[str, dict[str, float | None | str]]:
    import torch

    torch.manual_seed(0)
    x = torch.randn(rows, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.05
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    xq, sx = _per_row_fp8(x)
    wq, sw = _per_row_fp8(w)
    sw_row, sx_row = sw.t().contiguous(), sx.t().contiguous()
    one = torch.ones((), device="cuda")
    f16 = torch.float16
    variants: dict[str, tuple[Callable[[], torch.Tensor], bool]] = {  # name -> (fn, adds the bias)
        "fp16_linear_bias": (lambda: torch.nn.functional.linear(x, w, bias), True),
        "fp8_rowwise_bias": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw_row, bias=bias,
                                                      out_dtype=f16), True),
        "fp8_rowwise": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw_row, out_dtype=f16), False),
        "fp8_rowwise_fastacc": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw_row, out_dtype=f16,
                                                         use_fast_accum=True), False),
        "fp8_swapped": (lambda: torch._scaled_mm(wq, xq.t(), scale_a=sw, scale_b=sx_row, out_dtype=f16).t(), False),
        "fp8_tensorwise": (lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one, out_dtype=f16), None),
    }  # fmt: skip
    want = x.float() @ w.float().t()
    out: dict[str, dict[str, float | None | str]] = {}
    for name, (fn, adds_bias) in variants.items():
        try:
            got = fn().float()
            err = None  # tensor-wise unit scales compute a differently scaled product
            if adds_bias is not None:
                ref = want + bias.float() if adds_bias else want
                err = float((got - ref).abs().max() / ref.abs().max())
            out[name] = {"us": round(_graph_us(fn), 2), "rel_err": err}
        except Exception as exc:  # noqa: BLE001 - one variant a build lacks is reported, not fatal
            out[name] = {"error": repr(exc)[:200]}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64,32", help="comma-separated row counts (the decode batch)")
    p.add_argument("--json", help="also write the report here")
    args = p.parse_args(argv)
    report = {}
    for rows in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES:
            row = measure(rows, k, n)
            report[f"M{rows}_K{k}_N{n}"] = row
            print(f"M{rows} K{k} N{n}: " + "  ".join(f"{v}={r.get('us', 'error')}" for v, r in row.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()

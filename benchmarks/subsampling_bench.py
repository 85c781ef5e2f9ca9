"""The WeNet Conformer's CUDA fast paths (issue #23) beside the paths they replace, at WeNet's
shapes (64 x 30 s, fp16): the Conv2d x4 subsampling frames-last (first convolution as a GEMM,
the second channels-last, ``Conv2dSubsampling.forward_frames_last``) against NCHW cuDNN, and the
convolution module three ways: eval-mode BatchNorm folded into the depthwise convolution with
oasr-kernels' frames-major GLU + depthwise + SiLU kernel (``fold_kernel``), folded with the
native ops (``fold_native``), and the norm as its own pass with the native ops (``bn_native``,
what ran before). Prints one JSON object (ms, median of 10, and the largest difference).

    python -m benchmarks.subsampling_bench
"""

from __future__ import annotations

import json

import torch

import oasr.layers as L
from oasr.layers.conformer import ConformerConvModule, Conv2dSubsampling
from oasr.tune import cuda_event_timer


def timeit(fn) -> float:
    """Milliseconds per call: ``oasr.tune``'s CUDA-event timer (median of 10 after warm-up)."""
    return round(cuda_event_timer(repeats=10)(fn) * 1e3, 3)


def nchw(sub: Conv2dSubsampling, x: torch.Tensor) -> torch.Tensor:
    """What ``Conv2dSubsampling.forward`` ran on CUDA before the frames-last path."""
    h = x.unsqueeze(1)
    for conv in sub.conv:
        h = torch.relu_(conv(h))
    b, c, t, f = h.shape
    return sub.out(h.transpose(1, 2).reshape(b, t, c * f))


def measure(d: int, dev: str = "cuda", dt: torch.dtype = torch.float16) -> dict:
    torch.manual_seed(0)
    res = {}
    sub = Conv2dSubsampling(80, d, 4).to(dev, dt).eval()
    feats = torch.randn(64, 3000, 80, device=dev, dtype=dt)
    res[f"subsampling_d{d}_nchw_ms"] = timeit(lambda: nchw(sub, feats))
    res[f"subsampling_d{d}_frames_last_ms"] = timeit(lambda: sub.forward_frames_last(feats))
    diff = (nchw(sub, feats).float() - sub.forward_frames_last(feats).float()).abs().max()
    res[f"subsampling_d{d}_maxdiff"] = float(diff)
    m = ConformerConvModule(d, 15).to(dev, dt).eval()
    with torch.no_grad():
        m.norm.running_var.uniform_(0.5, 2.0)
        m.norm.running_mean.normal_()
    x = torch.randn(64, 749, d, device=dev, dtype=dt)
    valid = torch.ones(64, 749, dtype=torch.bool, device=dev)
    valid[1:, 600:] = False

    def native_ops(fn):
        with L.native_ops():
            return fn()

    res[f"conv_module_d{d}_fold_kernel_ms"] = timeit(lambda: m(x, valid))
    res[f"conv_module_d{d}_fold_native_ms"] = native_ops(lambda: timeit(lambda: m(x, valid)))
    ref = m(x, valid)[0]
    m.train()  # BatchNorm1d keeps its running statistics; training only turns the fold off
    res[f"conv_module_d{d}_bn_native_ms"] = native_ops(lambda: timeit(lambda: m(x, valid)))
    res[f"conv_module_d{d}_maxdiff"] = float(
        (native_ops(lambda: m(x, valid)[0]).float() - ref.float()).abs().max()
    )
    return res


def main() -> None:
    torch.set_grad_enabled(False)
    res = {"device": torch.cuda.get_device_name()}
    for d in (256, 512):
        res.update(measure(d))
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""Layout micro-benchmark (issue #23): two CUDA layout choices for the WeNet Conformer, timed
both ways at WeNet's shapes (64 x 30 s fp16) with the ops that follow them, since the layout each
one leaves decides their speed: (a) pointwise Conv1d on a (B, C, T) view of (B, T, C) frames as one
GEMM (F.linear) instead of cuDNN's conv1d; (b) the conv2d subsampling channels-last vs NCHW.
Prints one JSON object. Run on the H200 (tenth session, benchmarks/results/h200_session10/
conformer_layouts.json): (a) the GEMM is faster (d=256 0.36 vs 0.62 ms, d=512 0.53 vs 1.48 ms per
module) and is what `oasr.layers.Conv1d` does on CUDA; (b) channels-last is slower (d=256 15.6 vs
11.7 ms, d=512 33.6 vs 25.8 ms), so the subsampling stays NCHW.

    python benchmarks/conformer_layouts.py
"""

import json

import torch
import torch.nn.functional as F

torch.set_grad_enabled(False)
dev, dt = "cuda", torch.float16


def timeit(fn, reps=10):
    fn()
    torch.cuda.synchronize()
    best = 1e9
    for _ in range(reps):
        s, e = torch.cuda.Event(True), torch.cuda.Event(True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e))
    return round(best, 3)


def measure(d: int) -> dict:
    res = {}
    b, t, k = 64, 749, 15
    x = torch.randn(b, t, d, device=dev, dtype=dt)
    w1, b1 = torch.randn(2 * d, d, 1, device=dev, dtype=dt) * 0.05, torch.randn(2 * d, device=dev, dtype=dt)
    wd, bd = torch.randn(d, 1, k, device=dev, dtype=dt) * 0.1, torch.randn(d, device=dev, dtype=dt)
    rm, rv = torch.zeros(d, device=dev, dtype=dt), torch.ones(d, device=dev, dtype=dt)
    w2, b2 = torch.randn(d, d, 1, device=dev, dtype=dt) * 0.05, torch.randn(d, device=dev, dtype=dt)

    def module(pointwise):
        h = pointwise(x.transpose(1, 2), w1, b1)
        h = F.glu(h, dim=1)
        if h.stride(1) == 1:  # (B, T, C) memory: the NHWC depthwise path OASR takes
            h = F.conv2d(h.unsqueeze(2), wd.unsqueeze(2).contiguous(memory_format=torch.channels_last),
                         bd, padding=(0, k // 2), groups=d).squeeze(2)
        else:
            h = F.conv1d(h, wd, bd, padding=k // 2, groups=d)
        h = F.batch_norm(h, rm, rv, None, None, False, 0.0, 1e-5)
        h = F.silu(h)
        return pointwise(h, w2, b2).transpose(1, 2)

    def conv(h, w, bias):
        return F.conv1d(h, w, bias)

    def gemm(h, w, bias):
        return F.linear(h.transpose(1, 2), w[:, :, 0], bias).transpose(1, 2)

    res[f"conv_module_d{d}_conv1d_ms"] = timeit(lambda: module(conv))
    res[f"conv_module_d{d}_gemm_ms"] = timeit(lambda: module(gemm))
    res[f"conv_module_d{d}_maxdiff"] = (module(conv) - module(gemm)).abs().max().item()
    feats = torch.randn(b, 3000, 80, device=dev, dtype=dt)
    c1w, c1b = torch.randn(d, 1, 3, 3, device=dev, dtype=dt) * 0.3, torch.randn(d, device=dev, dtype=dt)
    c2w, c2b = torch.randn(d, d, 3, 3, device=dev, dtype=dt) * 0.02, torch.randn(d, device=dev, dtype=dt)

    def sub(cl):
        f = (lambda z: z.contiguous(memory_format=torch.channels_last)) if cl else (lambda z: z)
        h = torch.relu_(F.conv2d(f(feats.unsqueeze(1)), f(c1w), c1b, stride=2))
        h = torch.relu_(F.conv2d(f(h), f(c2w), c2b, stride=2))
        bb, c, tt, ff = h.shape
        return h.transpose(1, 2).reshape(bb, tt, c * ff)

    res[f"subsampling_d{d}_nchw_ms"] = timeit(lambda: sub(False))
    res[f"subsampling_d{d}_channels_last_ms"] = timeit(lambda: sub(True))
    return res


res = {}
for d in (256, 512):
    res.update(measure(d))
print(json.dumps(res, indent=1))

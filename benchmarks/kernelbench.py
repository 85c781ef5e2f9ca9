"""Each oasr-kernels kernel beside its native op (PyTorch) on representative shapes.

    python -m benchmarks.kernelbench --out kernels.json            # a CUDA GPU with CuPy
    python -m benchmarks.kernelbench --no-tune --out kernels.json  # the kernels' defaults
    python -m benchmarks.kernelbench --only add_norm,bias_act

Shapes: Whisper large-v3 (d = 1280, 20 heads, batch 64 x 1500 encoder frames; a batch-64 decode
step), Conformer d = 256 / 512 (WeNet / icefall / NeMo convolution modules), a Qwen2-style
language model (RMSNorm d = 3584, grouped-query prefill), Whisper's 128-bin log-mel of 64 x 30 s.
Each case times the native op (overrides off) and the kernel twice, with CUDA events (median of
``--repeats`` runs after warm-up): called eagerly from Python (``native_us``, ``kernel_us``:
includes the launch overhead, which dominates small shapes) and replayed from a CUDA graph of 10
calls (``graph_*_us``: GPU time only, what a call costs inside the executors' graphs). Ratios
are native / kernel (above 1 the kernel is faster); ``max_abs_diff`` compares the two outputs.
By default ``oasr.tune.autotune()`` runs first (fp16, into a temporary cache file the
kernels then read; ``--no-tune`` keeps the built-in defaults): its entries, with each key's
kernel and native times and ``use_kernel``, go into the report. The kernel cases call the
launchers directly, so a kernel is measured even where the dispatch would decline it. The
Whisper encoder case runs the whole large-v3 encoder (random weights, fp16, batch 8) with
the kernels on and off, and captured in a CUDA graph (:class:`oasr_models_whisper.encoder_graphs`
when present). Finishes in well under two minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def _timer(fn: Callable[[], Any], repeats: int) -> float:
    """Microseconds of GPU time per call, CUDA events around each (``oasr.tune``'s timer)."""
    from oasr.tune import cuda_event_timer

    return cuda_event_timer(repeats=repeats)(fn) * 1e6


def _graph_timer(fn: Callable[[], Any], repeats: int, inner: int = 10) -> float:
    """Microseconds of GPU time per call replayed from a CUDA graph of ``inner`` calls (no
    Python or launch overhead: what a call costs inside the executors' graphs); the autotuner's
    own timer, so the benchmark measures what ``oasr.tune`` decided on."""
    from oasr.tune import cuda_graph_timer

    us = cuda_graph_timer(repeats=repeats, inner=inner)(fn) * 1e6
    torch.cuda.empty_cache()
    return us


def _native(fn: Callable[[], Any]) -> Callable[[], Any]:
    import oasr.layers as L

    def run() -> Any:
        with L.native_ops():
            return fn()

    return run


def _first(x: Any) -> torch.Tensor:
    return x[1] if isinstance(x, tuple) else x


def _cases(dev: torch.device) -> list[tuple[str, str, dict, Callable[[], Any], Callable[[], Any]]]:
    """(op, label, shape, native call, kernel call)."""
    import oasr.layers as L
    from oasr.features.whisper import HOP_LENGTH, N_FFT, mel_filters
    from oasr.layers.conformer import DepthwiseConv1d
    from oasr.layers.llm import RMSNorm
    from oasr_kernels import fused, paged_attention, prefill_attention

    f16 = torch.float16
    out: list = []

    def rnd(*shape, dtype=f16):
        return torch.randn(*shape, device=dev).to(dtype)

    for label, rows, d in [("whisper-large-v3 encoder", 64 * 1500, 1280), ("whisper-large-v3 decode step", 64, 1280),
                           ("conformer d=256", 64 * 250, 256), ("conformer d=512", 64 * 250, 512)]:  # fmt: skip
        norm = L.LayerNorm(d, device=dev, dtype=f16)
        x, r = rnd(rows, d), rnd(rows, d)
        out.append(("add_norm", label, {"rows": rows, "dim": d}, _native(lambda x=x, r=r, n=norm: L.add_norm(x, r, n)),
                    lambda x=x, r=r, n=norm: fused.launch_add_norm("layer", x, r, n.weight, n.bias, n.eps)))  # fmt: skip
    for label, rows in [("qwen2 decode step", 64), ("qwen2 prefill", 4096)]:
        norm = RMSNorm(3584, device=dev, dtype=torch.bfloat16)
        x = rnd(rows, 3584, dtype=torch.bfloat16)
        out.append(("rms_norm", label, {"rows": rows, "dim": 3584}, _native(lambda x=x, n=norm: n(x)),
                    lambda x=x, n=norm: fused.launch_add_norm("rms", x, None, n.weight, None, n.eps)))  # fmt: skip
    for label, rows, d, act in [("whisper-large-v3 encoder MLP", 16 * 1500, 5120, "gelu"),
                                ("conformer FFN d=256", 64 * 250, 1024, "silu")]:  # fmt: skip
        x, b = rnd(rows, d), rnd(d)
        out.append(("bias_act", label, {"rows": rows, "dim": d, "act": act},
                    _native(lambda x=x, b=b, a=act: L.bias_act(x, b, a)), lambda x=x, b=b, a=act: fused.launch_bias_act(x, b, a)))  # fmt: skip
    for label, b, c, t, k in [("wenet conformer d=256", 64, 256, 250, 15), ("conformer d=512", 64, 512, 250, 31)]:
        conv = DepthwiseConv1d(c, k, padding=(k - 1) // 2, device=dev, dtype=f16)
        x = rnd(b, 2 * c, t)
        out.append(("glu_depthwise_conv1d", label, {"batch": b, "channels": c, "frames": t, "kernel": k},
                    _native(lambda x=x, m=conv: L.glu_depthwise_conv1d(x, m)),
                    lambda x=x, m=conv: fused.launch_glu_dwconv(x, m.weight, m.bias, m.padding)))  # fmt: skip
    audio = torch.randn(64, 480000, device=dev) * 0.1
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=torch.hann_window(N_FFT, device=dev), return_complex=True)
    filt = torch.from_numpy(mel_filters(128)).to(dev)
    out.append(("log_mel_power", "whisper 128 mels, 64 x 30 s", {"batch": 64, "mels": 128, "frames": 3000},
                _native(lambda: L.log_mel_power(stft, filt, 3000)), lambda: fused.launch_log_mel(stft, filt, 3000)))  # fmt: skip

    def paged(b, h, hkv, t, d, n, bs=16):
        nb = -(-n // bs)
        kp = rnd(b * nb + 1, bs, hkv, d)
        vp = rnd(b * nb + 1, bs, hkv, d)
        q = rnd(b, h, t, d)
        tables = (torch.randperm(b * nb, device=dev) + 1).view(b, nb)
        lengths = torch.full((b,), n, dtype=torch.long, device=dev)
        return q, kp, vp, tables, lengths

    args = paged(64, 20, 20, 1, 64, 448)
    out.append(("paged_decode_attention", "whisper-large-v3 decode, 64 rows x 448 keys",
                {"batch": 64, "heads": 20, "keys": 448, "head_dim": 64},
                _native(lambda a=args: L.paged_decode_attention(*a)), lambda a=args: paged_attention.paged_decode_attention_cuda(*a)))  # fmt: skip
    for label, shape in [("whisper prompt prefill, 64 rows x 4 tokens", (64, 20, 20, 4, 64, 4)),
                         ("qwen2 prefill, 4 rows x 512 tokens, GQA 28/4", (4, 28, 4, 512, 128, 512))]:  # fmt: skip
        args = paged(*shape)
        out.append(("paged_prefill_attention", label, dict(zip(("batch", "heads", "kv_heads", "tokens", "head_dim"), shape[:5], strict=True)),
                    _native(lambda a=args: L.paged_prefill_attention(*a)),
                    lambda a=args: prefill_attention.launch(*a, None)))  # the kernel even past MAX_TOKENS  # fmt: skip
    return out


_NETS: dict = {}


def _whisper_encoder(dev: torch.device, repeats: int, batch: int) -> list[dict]:
    """The large-v3 encoder (random weights) with the kernels off / on / in a CUDA graph."""
    from oasr_models_whisper.network import WhisperDims
    from oasr_models_whisper.nn import WhisperNet

    dims = WhisperDims(n_mels=128, n_audio_ctx=1500, n_audio_state=1280, n_audio_head=20, n_audio_layer=32,
                       n_vocab=51866, n_text_ctx=448, n_text_state=1280, n_text_head=20, n_text_layer=1)  # fmt: skip
    net = _NETS.get(dev)
    if net is None:
        torch.manual_seed(0)
        net = _NETS[dev] = WhisperNet(dims, device=dev, dtype=torch.float16).eval().requires_grad_(False)
        with torch.no_grad():
            for p in net.parameters():
                p.normal_(0, 0.02)
    mel = torch.randn(batch, 128, 3000, device=dev)
    rows: list[dict] = []
    native_us = _timer(_native(lambda: net.encode(mel)), repeats)
    kernel_us = _timer(lambda: net.encode(mel), repeats)
    diff = (net.encode(mel).float() - _native(lambda: net.encode(mel))().float()).abs().max().item()
    shape = {"batch": batch, "frames": 1500, "dim": 1280, "layers": 32}
    rows.append({"op": "whisper_encoder", "case": "large-v3 encoder, kernels on vs off", "shape": shape,
                 "dtype": "float16", "native_us": round(native_us, 1), "kernel_us": round(kernel_us, 1),
                 "ratio": round(native_us / kernel_us, 3), "max_abs_diff": diff})  # fmt: skip
    try:
        from oasr_models_whisper.encoder_graphs import EncoderGraphs
    except ImportError:
        return rows
    graphs = EncoderGraphs(net, buckets=(batch,))
    graph_us = _timer(lambda: graphs(mel), repeats)
    diff = (graphs(mel).float() - net.encode(mel).float()).abs().max().item()
    rows.append({"op": "whisper_encoder_graph", "case": "large-v3 encoder, CUDA graph vs eager (kernels on)",
                 "shape": shape, "dtype": "float16", "native_us": round(kernel_us, 1), "kernel_us": round(graph_us, 1),
                 "ratio": round(kernel_us / graph_us, 3), "max_abs_diff": diff})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kernelbench", description=__doc__.split("\n")[0],
                                 allow_abbrev=False)  # fmt: skip
    ap.add_argument("--out", help="write the JSON report here")
    ap.add_argument("--only", help="comma-separated ops (default: all)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--no-tune", action="store_true",
                    help="skip autotuning (by default oasr.tune.autotune() runs first, fp16, into a "
                         "temporary cache file, and its entries go into the report)")  # fmt: skip
    ap.add_argument("--tune", action="store_true", help="autotune first (the default; kept for older command lines)")
    ap.add_argument("--tune-cache", help="autotune into this file instead (kept)")
    ap.add_argument("--tune-dtypes", default="float16", help="dtypes to autotune (comma-separated)")
    ap.add_argument("--encoder-batch", default="1,8", help="batches of the Whisper encoder case (comma-separated; 0: skip it)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernelbench needs a CUDA GPU", file=sys.stderr)
        return 2
    from oasr_kernels.provider import install

    install("cuda")
    dev = torch.device("cuda")
    started = time.perf_counter()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "cases": []}
    if not args.no_tune:
        import os
        import tempfile

        from oasr import tune

        path = args.tune_cache or os.path.join(tempfile.mkdtemp(prefix="oasr-kernelbench-"), "autotune.json")
        os.environ["OASR_AUTOTUNE_CACHE"] = path  # the kernels below read this file
        tune.clear_memory_cache()
        t0 = time.perf_counter()
        tuned = tune.autotune(dtypes=args.tune_dtypes.split(","), path=path)
        report["autotune"] = {"path": tuned["path"], "seconds": round(time.perf_counter() - t0, 1),
                              "arch": tuned["arch"], "entries": tuned["entries"]}  # fmt: skip
        for op, by_key in tuned["entries"].items():
            for key, e in by_key.items():
                print(f"autotune {op:24s} {key:28s} {e['params']}  kernel {e['us']:.2f} us  native {e['native_us']} us",
                      flush=True)  # fmt: skip
    only = set(args.only.split(",")) if args.only else None
    with torch.no_grad():
        for op, label, shape, native, kernel in _cases(dev):
            if only and op not in only:
                continue
            first = kernel()
            if first is None or first is NotImplemented:
                report["cases"].append({"op": op, "case": label, "shape": shape, "error": "kernel declined the input"})
                continue
            native_us = _timer(native, args.repeats)
            kernel_us = _timer(kernel, args.repeats)
            g_native = _graph_timer(native, args.repeats)
            g_kernel = _graph_timer(kernel, args.repeats)
            diff = (_first(kernel()).float() - _first(native()).float()).abs().max().item()
            row = {"op": op, "case": label, "shape": shape, "native_us": round(native_us, 1),
                   "kernel_us": round(kernel_us, 1), "ratio": round(native_us / kernel_us, 3),
                   "graph_native_us": round(g_native, 2), "graph_kernel_us": round(g_kernel, 2),
                   "graph_ratio": round(g_native / g_kernel, 3), "max_abs_diff": diff}  # fmt: skip
            report["cases"].append(row)
            print(f"{op:24s} {label:48s} eager {native_us:8.1f} / {kernel_us:8.1f} us x{native_us / kernel_us:5.2f}"
                  f"  graph {g_native:8.2f} / {g_kernel:8.2f} us x{g_native / g_kernel:5.2f}  diff {diff:.2e}",
                  flush=True)  # fmt: skip
        batches = [int(b) for b in str(args.encoder_batch).split(",") if int(b) > 0]
        for batch in batches if only is None or "whisper_encoder" in only else []:
            for row in _whisper_encoder(dev, max(3, args.repeats // 4), batch):
                report["cases"].append(row)
                print(f"{row['op']:24s} {row['case']:48s} {row['native_us']:9.1f} us -> {row['kernel_us']:9.1f} us  "
                      f"x{row['ratio']:5.2f}  diff {row['max_abs_diff']:.2e}", flush=True)  # fmt: skip
    report["seconds"] = round(time.perf_counter() - started, 1)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(report, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

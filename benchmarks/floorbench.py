"""What the GPU allows for Qwen2-Audio at batch 32 (issue #19), measured component by component.

    python -m benchmarks.floorbench --json floor.json       # a CUDA GPU, ~30 s
    python -m benchmarks.floorbench --repeats 5 --oasr-phases encoder=0.15,prefill=0.56,...

The workload is ``benchmarks.qwenbench``'s default (7B shapes, bf16, 30 s inputs, 100 generated
tokens, batch 32; prompt = 750 audio tokens + 91 chat-template tokens of the bench tokenizer).
Each floor is built from torch's own best kernels at the real shapes (CUDA events, warm-up,
medians): GEMMs via ``F.linear`` (cuBLAS and cuBLASLt, the faster), attention via SDPA (the
fastest of cuDNN / flash / efficient), decode-step GEMMs replayed from CUDA graphs, and
elementwise work (norms, activations, residual adds, rotary, K/V stores) and the decode K/V
reads counted in bytes at the measured copy / read bandwidth. Printed: a table "component |
floor | OASR | OASR/floor" (OASR's phases from ``--oasr-phases``, ``qwenbench --torch-profile``'s
names) and the breakdown; ``--json`` writes everything, with TFLOP/s per GEMM shape. Not
modelled: the log-mel features, host time, and the decode step's small kernels' fixed cost (a
step's norms, rotary and stores count only their bytes).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

BF16 = 2  # bytes per element
DEVICE = "cuda"
STREAM_BYTES = 8 * 2**30  # the bandwidth tests' tensor
#: session 14, call 1 (``qwenbench --batch-sizes 32 --torch-profile``): seconds per phase;
#: prefill and decode_steps include the sampling inside them
OASR_PHASES = (
    "features=0.0177,encoder=0.1446,prefill=0.5578,decode_steps=0.8865,sampling=0.0314,wall=1.6242"
)


# ----------------------------------------------------------------- arithmetic (no torch)
def audio_lengths(mel_frames: int) -> tuple[int, int]:
    """(frames after the stride-2 conv, audio tokens after the 2x pooling) of a full window."""
    conv = (mel_frames - 1) // 2 + 1
    return conv, (conv - 2) // 2 + 1


def workload(batch: int = 32, tokens: int = 100, text_tokens: int = 91) -> dict[str, Any]:
    from benchmarks.qwenbench import SHAPES

    a, t = SHAPES["7b"]["audio"], SHAPES["7b"]["text"]
    frames, audio_tokens = audio_lengths(3000)
    hd = t["hidden_size"] // t["num_attention_heads"]
    return {"batch": batch, "tokens": tokens, "mel_frames": 3000, "n_mels": 128, "frames": frames,
            "audio_tokens": audio_tokens, "prompt": audio_tokens + text_tokens, "d": a["d_model"],
            "enc_layers": a["encoder_layers"], "enc_heads": a["encoder_attention_heads"],
            "ffn": a["encoder_ffn_dim"], "hidden": t["hidden_size"], "inter": t["intermediate_size"],
            "layers": t["num_hidden_layers"], "heads": t["num_attention_heads"], "head_dim": hd,
            "kv_width": t["num_key_value_heads"] * hd, "vocab": t["vocab_size"]}  # fmt: skip


def linear_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def attention_flops(b: int, h: int, q: int, k: int, d: int, causal: bool) -> int:
    """q.k and p.v multiply-adds over the attended (query, key) pairs; causal queries are the
    last ``q`` of ``k`` positions."""
    pairs = q * (k - q) + q * (q + 1) // 2 if causal else q * k
    return 4 * b * h * d * pairs


def kv_read_bytes(w: dict[str, Any]) -> list[int]:
    """K/V bytes each decode step reads: step j feeds generated token j+1 at position prompt+j
    and attends prompt+j+1 positions (its own included); tokens-1 steps after the prefill."""
    per_pos = w["layers"] * 2 * w["batch"] * w["kv_width"] * BF16
    return [per_pos * (w["prompt"] + j + 1) for j in range(w["tokens"] - 1)]


def encoder_elementwise_bytes(w: dict[str, Any]) -> int:
    """Stem: GELU after each conv, the (B, T, d) transpose, + positions; per layer two fused
    residual add + LayerNorm (read 2, write 2) and the GELU; tail: 2x pooling, final LayerNorm."""
    n, d = w["batch"] * w["frames"], w["d"]
    stem = 2 * w["batch"] * d * w["mel_frames"] + 2 * n * d + 2 * n * d + 2 * n * d
    per_layer = 8 * n * d + 2 * n * w["ffn"]
    tail = n * d + n * d // 2 + n * d
    return BF16 * (stem + w["enc_layers"] * per_layer + tail)


def decoder_layer_elements(rows: int, w: dict[str, Any]) -> int:
    """Two fused residual add + RMSNorm, rotary on q and k, the K/V store copy, silu(gate)*up."""
    qk = w["heads"] * w["head_dim"] + w["kv_width"]
    return rows * (8 * w["hidden"] + 2 * qk + 4 * w["kv_width"] + 3 * w["inter"])


def prefill_elementwise_bytes(w: dict[str, Any]) -> int:
    """Embeddings + first norm, all layers but the last in full; the last layer (last position
    only past its K/V) rotates and stores every position, the rest on one row per request."""
    n, b, h = w["batch"] * w["prompt"], w["batch"], w["hidden"]
    qk = w["heads"] * w["head_dim"] + w["kv_width"]
    last = n * (2 * qk + 4 * w["kv_width"]) + b * (8 * h + 3 * w["inter"])
    return BF16 * (4 * n * h + (w["layers"] - 1) * decoder_layer_elements(n, w) + last)


def decode_step_elementwise_bytes(w: dict[str, Any]) -> int:
    return BF16 * (
        4 * w["batch"] * w["hidden"] + w["layers"] * decoder_layer_elements(w["batch"], w)
    )


def parse_phases(text: str) -> dict[str, float]:
    phases = {
        k.strip(): float(v) for k, v in (kv.split("=", 1) for kv in text.split(",") if kv.strip())
    }
    missing = {"encoder", "prefill", "decode_steps", "sampling", "wall"} - set(phases)
    if missing:
        raise ValueError(f"--oasr-phases lacks {sorted(missing)}")
    return phases


def table_rows(
    floor: dict[str, float], oasr: dict[str, float], steps: int
) -> list[tuple[str, float | None, float]]:
    """(component, floor s, OASR s); per-step rows in ms."""
    other = oasr["wall"] - oasr["encoder"] - oasr["prefill"] - oasr["decode_steps"]
    return [("audio encoder + projector (s)", floor["encoder"], oasr["encoder"]),
            ("prefill + 1st sampling (s)", floor["prefill"], oasr["prefill"]),
            (f"decode, {steps} steps + sampling (s)", floor["decode"], oasr["decode_steps"]),
            ("  per decode step (ms)", 1e3 * floor["decode"] / steps, 1e3 * oasr["decode_steps"] / steps),
            (f"  sampling, {steps + 1} calls (s, inside above)", floor["sampling"], oasr["sampling"]),
            ("features + host, not modelled (s)", None, other),
            ("total (s)", floor["encoder"] + floor["prefill"] + floor["decode"], oasr["wall"])]  # fmt: skip


# ----------------------------------------------------------------- measurement (CUDA)
def _ms(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Median GPU milliseconds per call: ``oasr.tune``'s CUDA-event timer (3 warm-up calls)
    around ``inner`` calls back to back (the host's time to launch the first is the only idle
    gap, shared by all)."""
    from oasr.tune import cuda_event_timer

    def calls() -> None:
        for _ in range(inner):
            fn()

    return cuda_event_timer(repeats=repeats)(calls) * 1e3 / inner


def _graph_ms(fn: Callable[[], Any], repeats: int, inner: int = 1) -> float:
    """Milliseconds per call of ``inner`` calls captured in one CUDA graph and replayed (no launch
    overhead): ``oasr.tune``'s graph timer, the one kernelbench and the autotuner use (a call
    that cannot be captured is timed eagerly there)."""
    from oasr.tune import cuda_graph_timer

    return cuda_graph_timer(repeats=repeats, inner=inner)(fn) * 1e3


def _free() -> None:
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _blas(lib: str | None = None) -> None:
    """Prefer ``lib`` for torch's GEMMs (None: the library torch started with)."""
    import torch

    global _BLAS_DEFAULT
    if _BLAS_DEFAULT is None:
        _BLAS_DEFAULT = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
    torch.backends.cuda.preferred_blas_library(lib or _BLAS_DEFAULT)


BLAS = ("cublas", "cublaslt")
_BLAS_DEFAULT: str | None = None


def bandwidth(repeats: int) -> dict[str, Any]:
    """8 GiB read by ``sum`` (bf16, and the same bytes as fp32), 8 GiB -> 8 GiB copy."""
    import torch

    n = STREAM_BYTES // BF16
    src = torch.zeros(n, dtype=torch.bfloat16, device=DEVICE)
    out: dict[str, Any] = {"bytes": n * BF16}
    out["read_bf16_sum_gbps"] = n * BF16 / _ms(lambda: src.sum(), repeats) / 1e6
    out["read_fp32_sum_gbps"] = n * BF16 / _ms(lambda: src.view(torch.float32).sum(), repeats) / 1e6
    dst = torch.empty_like(src)
    out["copy_gbps"] = 2 * n * BF16 / _ms(lambda: dst.copy_(src), repeats) / 1e6  # read + write
    out["read_gbps"] = max(out["read_bf16_sum_gbps"], out["read_fp32_sum_gbps"])
    return out


def linear(m: int, k: int, n: int, bias: bool, repeats: int) -> dict[str, Any]:
    """``F.linear`` bf16 (m, k) x (n, k)^T (+ bias), the faster BLAS library."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k, dtype=torch.bfloat16, device=DEVICE)
    wt = torch.randn(n, k, dtype=torch.bfloat16, device=DEVICE) * 0.02
    b = torch.randn(n, dtype=torch.bfloat16, device=DEVICE) if bias else None
    per_lib = {}
    for lib in BLAS:
        _blas(lib)
        per_lib[lib] = _ms(lambda: F.linear(x, wt, b), repeats, inner=3)
    _blas()
    ms = min(per_lib.values())
    return {"m": m, "k": k, "n": n, "bias": bias, "ms": ms, "ms_per_lib": per_lib,
            "tflops": linear_flops(m, k, n) / ms / 1e9}  # fmt: skip


def sdpa(
    b: int, h: int, q_len: int, k_len: int, d: int, causal: bool, repeats: int
) -> dict[str, Any]:
    """Fastest SDPA backend over (b, h, len, d) bf16 in the models' (b, len, h, d) layout."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(b, q_len, h, d, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    k, v = (
        torch.randn(b, k_len, h, d, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
        for _ in range(2)
    )
    per_backend: dict[str, float | None] = {}

    def call() -> Any:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal and q_len > 1)

    for name in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"):
        try:  # a backend that declines says why (a warning), then raises
            with warnings.catch_warnings(), sdpa_kernel([getattr(SDPBackend, name)]):
                warnings.simplefilter("ignore")
                per_backend[name] = _ms(call, repeats, inner=5)
        except RuntimeError:  # this backend does not take these inputs
            per_backend[name] = None
    done = {n: t for n, t in per_backend.items() if t is not None}
    best = min(done, key=done.get)
    return {"shape": [b, h, q_len, k_len, d], "causal": causal, "ms": done[best], "backend": best,
            "ms_per_backend": per_backend,
            "tflops": attention_flops(b, h, q_len, k_len, d, causal) / done[best] / 1e9}  # fmt: skip


def conv_stem(w: dict[str, Any], repeats: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    kw = {"dtype": torch.bfloat16, "device": DEVICE}
    mel = torch.randn(w["batch"], w["n_mels"], w["mel_frames"], **kw)
    w1, b1 = torch.randn(w["d"], w["n_mels"], 3, **kw) * 0.05, torch.randn(w["d"], **kw)
    w2, b2 = torch.randn(w["d"], w["d"], 3, **kw) * 0.02, torch.randn(w["d"], **kw)
    mid = F.conv1d(mel, w1, b1, padding=1)
    ms1 = _ms(lambda: F.conv1d(mel, w1, b1, padding=1), repeats, inner=3)
    ms2 = _ms(lambda: F.conv1d(mid, w2, b2, stride=2, padding=1), repeats, inner=3)
    flops = 2 * w["batch"] * w["d"] * 3 * (w["mel_frames"] * w["n_mels"] + w["frames"] * w["d"])
    return {"ms": ms1 + ms2, "conv1_ms": ms1, "conv2_ms": ms2, "tflops": flops / (ms1 + ms2) / 1e9}


def decode_gemms(w: dict[str, Any], repeats: int) -> dict[str, Any]:
    """One decode step's GEMMs at M = batch over every layer's own weights (no L2 reuse), each
    shape alone and all four per layer together, replayed from CUDA graphs; lm_head; sampling."""
    import torch
    import torch.nn.functional as F

    kw = {"dtype": torch.bfloat16, "device": DEVICE}
    h, i, lyr, m = w["hidden"], w["inter"], w["layers"], w["batch"]
    shapes = {"qkv": (h, w["heads"] * w["head_dim"] + 2 * w["kv_width"], True), "o": (h, h, False),
              "gate_up": (h, 2 * i, False), "down": (i, h, False)}  # fmt: skip
    weights = {s: torch.empty(lyr, n, k, **kw).normal_(0, 0.02) for s, (k, n, _) in shapes.items()}
    bias = torch.randn(lyr, shapes["qkv"][1], **kw)
    xs = {s: torch.randn(m, k, **kw) for s, (k, _, _) in shapes.items()}

    def run(names: tuple[str, ...]) -> None:
        for layer in range(lyr):
            for s in names:
                F.linear(xs[s], weights[s][layer], bias[layer] if s == "qkv" else None)

    out: dict[str, Any] = {"shapes": {}, "layer_graph_ms_per_lib": {}}
    for lib in BLAS:
        _blas(lib)
        out["layer_graph_ms_per_lib"][lib] = _graph_ms(lambda: run(tuple(shapes)), repeats)
        for s, (k, n, _) in shapes.items():
            row = out["shapes"].setdefault(s, {"m": m, "k": k, "n": n, "ms_per_lib": {}})
            row["ms_per_lib"][lib] = _graph_ms(lambda s=s: run((s,)), repeats) / lyr
    for row in out["shapes"].values():
        row["ms"] = min(row["ms_per_lib"].values())
        row["tflops"] = linear_flops(m, row["k"], row["n"]) / row["ms"] / 1e9
        row["weight_gbps"] = row["k"] * row["n"] * BF16 / row["ms"] / 1e6
    out["gemms_ms"] = min(out["layer_graph_ms_per_lib"].values())  # all layers, one step
    out["gemms_ms_best_lib_per_shape"] = lyr * sum(r["ms"] for r in out["shapes"].values())
    out["weight_bytes"] = sum(t.numel() for t in weights.values()) * BF16
    lm = torch.empty(w["vocab"], h, **kw).normal_(0, 0.02)
    x = torch.randn(m, h, **kw)
    out["lm_head_ms_per_lib"] = {}
    for lib in BLAS:
        _blas(lib)
        out["lm_head_ms_per_lib"][lib] = _graph_ms(lambda: F.linear(x, lm), repeats)
    _blas()
    out["lm_head_ms"] = min(out["lm_head_ms_per_lib"].values())
    logits = F.linear(x, lm)
    out["sampling_ms"] = _graph_ms(lambda: torch.argmax(logits.float(), -1), repeats, 10)  # greedy
    return out


def _done(stage: str) -> None:
    _free()  # the stage's tensors, dead now, leave the cache: at most one stage's in memory
    print(f"floorbench: {stage} done", file=sys.stderr, flush=True)


def measure(w: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Every measurement, and each component's floor in seconds by part (``parts_s``)."""
    rep: dict[str, Any] = {"bandwidth": bandwidth(repeats)}
    read_bw, copy_bw = rep["bandwidth"]["read_gbps"] * 1e9, rep["bandwidth"]["copy_gbps"] * 1e9
    _done("bandwidth")

    b, d, ne = w["batch"], w["d"], w["batch"] * w["frames"]
    enc = {"gemms": {"qkv_fused": linear(ne, d, 3 * d, True, repeats), "q_or_k_or_v": linear(ne, d, d, True, repeats),
                     "out": linear(ne, d, d, True, repeats), "fc1": linear(ne, d, w["ffn"], True, repeats),
                     "fc2": linear(ne, w["ffn"], d, True, repeats)},
           "attention": sdpa(b, w["enc_heads"], w["frames"], w["frames"], d // w["enc_heads"], False, repeats),
           "conv_stem": conv_stem(w, repeats),
           "projector": linear(b * w["audio_tokens"], d, w["hidden"], True, repeats)}  # fmt: skip
    g = enc["gemms"]
    qkv_ms = min(g["qkv_fused"]["ms"], 3 * g["q_or_k_or_v"]["ms"])
    enc["elementwise_bytes"] = encoder_elementwise_bytes(w)
    enc["parts_s"] = {"gemm": (w["enc_layers"] * (qkv_ms + g["out"]["ms"] + g["fc1"]["ms"] + g["fc2"]["ms"])
                               + enc["projector"]["ms"]) / 1e3,
                      "attention": w["enc_layers"] * enc["attention"]["ms"] / 1e3,
                      "conv_stem": enc["conv_stem"]["ms"] / 1e3,
                      "elementwise": enc["elementwise_bytes"] / copy_bw}  # fmt: skip
    rep["encoder"] = enc
    _done("encoder")

    dec = decode_gemms(w, repeats)
    rep["decode"] = dec
    _done("decode GEMMs")

    h, n, lyr, p = w["hidden"], b * w["prompt"], w["layers"], w["prompt"]
    qkv_n = w["heads"] * w["head_dim"] + 2 * w["kv_width"]
    pre = {"tokens": n,
           "gemms": {"qkv": linear(n, h, qkv_n, True, repeats), "o": linear(n, h, h, False, repeats),
                     "gate_up": linear(n, h, 2 * w["inter"], False, repeats),
                     "down": linear(n, w["inter"], h, False, repeats)},
           "attention": sdpa(b, w["heads"], p, p, w["head_dim"], True, repeats),
           "attention_last_query": sdpa(b, w["heads"], 1, p, w["head_dim"], True, repeats)}  # fmt: skip
    g = pre["gemms"]
    rest = g["o"]["ms"] + g["gate_up"]["ms"] + g["down"]["ms"]
    # the last layer's o / gate_up / down run on the last position only: M = batch
    last_rest = sum(dec["shapes"][s]["ms"] for s in ("o", "gate_up", "down"))
    pre["elementwise_bytes"] = prefill_elementwise_bytes(w)
    pre["parts_s"] = {"gemm": (lyr * g["qkv"]["ms"] + (lyr - 1) * rest + last_rest + dec["lm_head_ms"]) / 1e3,
                      "attention": ((lyr - 1) * pre["attention"]["ms"] + pre["attention_last_query"]["ms"]) / 1e3,
                      "elementwise": pre["elementwise_bytes"] / copy_bw,
                      "sampling": dec["sampling_ms"] / 1e3}  # fmt: skip
    rep["prefill"] = pre
    _done("prefill")

    kv = kv_read_bytes(w)
    steps = len(kv)
    dec["kv_read_bytes"] = sum(kv)
    dec["parts_s"] = {"gemm": steps * (dec["gemms_ms"] + dec["lm_head_ms"]) / 1e3, "kv_read": sum(kv) / read_bw,
                      "elementwise": steps * decode_step_elementwise_bytes(w) / copy_bw,
                      "sampling": steps * dec["sampling_ms"] / 1e3}  # fmt: skip
    return rep


def report_text(
    rep: dict[str, Any], rows: list[tuple[str, float | None, float]], target: float
) -> str:
    lines = [f"{'component':<44} {'floor':>9} {'OASR':>9} {'OASR/floor':>10}"]
    for name, fl, oasr in rows:
        ratio = f"{oasr / fl:10.2f}" if fl else f"{'-':>10}"
        lines.append(f"{name:<44} {('-' if fl is None else f'{fl:.4f}'):>9} {oasr:9.4f} {ratio}")
    total = rows[-1][1] or 0.0
    lines.append(f"3x transformers ({rep['transformers_s']} s) needs <= {target:.3f} s; the floor is "
                 f"{total:.3f} s ({100 * total / target:.0f} % of that)")  # fmt: skip
    for c in ("encoder", "prefill", "decode"):
        parts = ", ".join(f"{k} {v:.4f}" for k, v in rep[c]["parts_s"].items())
        lines.append(f"  {c} floor (s): {parts}")
    bw = rep["bandwidth"]
    lines.append(
        f"bandwidth: read {bw['read_gbps']:.0f} GB/s, copy {bw['copy_gbps']:.0f} GB/s (read + write)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.floorbench", description=__doc__.split("\n")[0])  # fmt: skip
    p.add_argument("--json", type=Path, help="write the full report here")
    p.add_argument(
        "--repeats", type=int, default=10, help="timed runs per median, after 3 warm-ups"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=100, help="generated tokens per request")
    p.add_argument("--text-tokens", type=int, default=91,
                   help="prompt tokens besides the audio's (qwenbench's chat prompt and tokenizer)")  # fmt: skip
    p.add_argument("--oasr-phases", default=OASR_PHASES,
                   help="OASR's seconds per phase, as qwenbench --torch-profile names them")  # fmt: skip
    p.add_argument("--transformers-s", type=float, default=3.80,
                   help="transformers' batch time, for the 3x target line (session 14 median)")  # fmt: skip
    args = p.parse_args(argv)
    try:
        oasr = parse_phases(args.oasr_phases)
    except ValueError as e:
        p.error(str(e))
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.floorbench measures a CUDA GPU; torch sees none here")
    w = workload(args.batch, args.tokens, args.text_tokens)
    rep = measure(w, max(1, args.repeats))
    floor = {c: sum(rep[c]["parts_s"].values()) for c in ("encoder", "prefill", "decode")}
    floor["sampling"] = rep["decode"]["sampling_ms"] * args.tokens / 1e3
    rows = table_rows(floor, oasr, args.tokens - 1)
    target = args.transformers_s / 3
    rep.update({"benchmark": "floorbench", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                "workload": w, "repeats": args.repeats, "oasr_phases": oasr, "transformers_s": args.transformers_s,
                "target_3x_s": target, "floor_s": floor,
                "table": [{"component": c, "floor": f, "oasr": o, "oasr_over_floor": (o / f if f else None)}
                          for c, f, o in rows]})  # fmt: skip
    text = report_text(rep, rows, target)
    print(text, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rep, indent=2, default=str))
    else:
        print(json.dumps(rep, indent=2, default=str))
    return rep


if __name__ == "__main__":
    main()

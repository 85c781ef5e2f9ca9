#!/usr/bin/env bash
# h3 (issue #19, Qwen2-Audio batch 32): new oasr-kernels ops rotary_qk + silu_mul (csrc/llm_ops.cu)
# and the Qwen decoder's residual adds fused into the next RMSNorm (add_norm, rms mode, existing kernel).
# Run from the repo root; PYTHONPATH set by the lead; $OUT/h3/ exists. Budget <= 120 s.
# Outputs: $OUT/h3/log.txt (tests + benchmark stderr rows), $OUT/h3/qwen_b32.json (report + phases + profile).
export OASR_KERNELS_UNVERIFIED=1  # the kernels under test decline without it (oasr_kernels/provider.py)
set -u
mkdir -p "$OUT/h3"
LOG="$OUT/h3/log.txt"
{
  echo "== GPU tests (expect all pass: kernels bit-exact vs native for rotary_qk; silu_mul within 1 ulp,"
  echo "   its prints say whether bit-exact; Qwen greedy parity vs transformers fp32 on CUDA; bf16 engine + graphs)"
  timeout 38 python -m pytest -m gpu -q -s -p no:cacheprovider -o addopts="--import-mode=importlib" \
    tests/kernels/test_llm_ops_gpu.py tests/qwen/test_gpu.py 2>&1 | grep -v "^$" | tail -40
  echo "== qwenbench batch 32 (batch 1 left out to fit 120 s; it had 4.01x and only loses kernels), 7B shapes bf16, 30 s, 100 tokens, beside transformers, phases + torch profile"
  # Session 8 (before): b32 oasr 1.91 s vs transformers 4.43 s (2.32x); phases: encoder 0.189 s,
  # prefill 0.696 s, decode 9.70 ms/step. Expected now: prefill ~0.58-0.62 s (rotary 4 kernels + key
  # copy -> 1, silu+mul over strided halves -> 1 vectorised pass, residual adds fused into norms),
  # decode ~9.1-9.3 ms/step (about 4 fewer small kernels per layer in the graph), encoder unchanged;
  # b32 wall ~1.75-1.8 s (~2.5x). In torch_profile.top: no aten::cat /
  # CatArrayBatchedCopy rows from the rotary, oasr_rotary_qk_bf16 and oasr_silu_mul_bf16_v present.
  timeout 70 python -m benchmarks.qwenbench --batch-sizes 32 --torch-profile --json "$OUT/h3/qwen_b32.json" \
    2>&1 | grep -E '^\{"batch|Traceback|Error|error|oasr_rotary|oasr_silu|paged_decode|aten::(mul|cat|silu|add) ' | head -40
  # Bonus when time is left (<= 118 s in all): the same ops on vs off (native = the code before) in one
  # process, 4 decoder layers at 7B width: expect prefill ms/layer on < off by ~2-4 ms (off ~20 ms/layer),
  # decode graph ms/layer on < off by ~0.01-0.02 ms; max_abs_diff small (0 if add_norm/silu_mul round as native).
  if [ "$SECONDS" -le 100 ]; then
    echo "== A/B at ${SECONDS}s"
    timeout $((118 - SECONDS)) python - <<'PY' 2>&1 | tail -5
# A/B of h3's ops at Qwen2-Audio 7B width (4 decoder layers, bf16, H200): the decoder's prefill of
# 32 x 900 tokens (eager) and a 32-row decode step (CUDA graph) with the rotary_qk / silu_mul /
# add_norm kernels on, then off (native ops: the code before); ms per layer, and how far the
# outputs differ (rotary_qk is bit-exact; add_norm's rms kernel and silu_mul may round differently).
import json
import time

import torch

import oasr.layers as L
from oasr.kernel_providers import install_kernel_providers
from oasr.layers.attention import attention
from oasr_models_qwen.config import TextDims
from oasr_models_qwen.nn import Qwen2Decoder

install_kernel_providers("cuda")
OPS = ("rotary_qk", "silu_mul", "add_norm")
saved = {op: fn for (op, dev), fn in L.list_overrides().items() if dev == "cuda" and op in OPS}
NL, B, T, S = 4, 32, 900, 900
torch.manual_seed(0)
dec = Qwen2Decoder(TextDims(intermediate=11008, layers=NL, vocab=1024), device="cuda", dtype=torch.bfloat16).eval()
x = torch.randn(B, T, 4096, device="cuda", dtype=torch.bfloat16)
pos = torch.arange(T, device="cuda").expand(B, T)
kc = torch.randn(B, 32, S, 128, device="cuda", dtype=torch.bfloat16)
x1, pos1 = x[:, :1].clone(), torch.full((B, 1), S - 1, device="cuda")


def prefill_attend(li, q, k, v):
    k = k.view(B, -1, 32, 128).transpose(1, 2)
    v = v.reshape(B, -1, 32, 128).transpose(1, 2)
    return attention(q, k, v, is_causal=True)


def decode_attend(li, q, k, v):
    return attention(q, kc, kc)


def run(on):
    for op, fn in saved.items():
        (L.register_override(op, "cuda", fn) if on else L.unregister_override(op, "cuda"))
    with torch.inference_mode():
        for _ in range(2):
            out_p = dec(x, pos, prefill_attend)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            out_p = dec(x, pos, prefill_attend)
        torch.cuda.synchronize()
        prefill = (time.perf_counter() - t0) / 5
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                dec(x1, pos1, decode_attend)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out_d = dec(x1, pos1, decode_attend)
        g.replay()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.replay()
        torch.cuda.synchronize()
        decode = (time.perf_counter() - t0) / 50
    return prefill, decode, out_p.float(), out_d.float().clone()


p_on, d_on, op_on, od_on = run(True)
p_off, d_off, op_off, od_off = run(False)
print(json.dumps({"h3_ab": "4 layers at 7B width, ms per layer", "kernels_on": sorted(saved),
                  "prefill_ms_per_layer_on": round(1e3 * p_on / NL, 3), "prefill_ms_per_layer_off": round(1e3 * p_off / NL, 3),
                  "decode_graph_ms_per_layer_on": round(1e3 * d_on / NL, 4), "decode_graph_ms_per_layer_off": round(1e3 * d_off / NL, 4),
                  "prefill_max_abs_diff": float((op_on - op_off).abs().max()), "decode_max_abs_diff": float((od_on - od_off).abs().max()),
                  "prefill_out_absmax": float(op_off.abs().max())}))
PY
  else
    echo "== A/B skipped (no time left: ${SECONDS}s)"
  fi
} > "$LOG" 2>&1
echo "h3 done; see $LOG"

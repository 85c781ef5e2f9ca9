# qwen (issue #19): Qwen2-Audio on the H200. Expected: GPU tests pass (3: fp32 parity, bf16 engine, 30 s windows fp32 parity);
# qwenbench batch 1 >= 4x as before; batch 32 faster than 2.42 s (phases: encoder ~0.1-0.2 s, prefill ~0.5 s, decode ~10 ms/step
# expected); "phases" and "torch_profile" in the JSON show where the rest goes.
timeout 60 python3 -m pytest -q -m gpu tests/qwen -p no:cacheprovider 2>&1 | tail -15
timeout 110 python3 -m benchmarks.qwenbench --batch-sizes 1,32 --tokens 100 --torch-profile --json $OUT/qwen/qwenbench.json 2>&1 | tail -60

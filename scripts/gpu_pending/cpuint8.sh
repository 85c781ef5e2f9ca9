# cpuint8 (issue #22, CPU int8): the CUDA path is meant to be unchanged (the tied output
# projection is quantized only on the CPU); this checks the shared code (quantize_weight in row
# blocks, reference_linear's loop, QuantizedLinear._int8 rows bookkeeping) on the H200.
# Expected: all pass / skip as before; quantbench device tiny prints speedups as in earlier runs.
timeout 100 python3 -m pytest -q -x tests/quantization/test_gpu.py tests/quantization/test_numerics.py tests/quantization/test_tied.py -p no:cacheprovider 2>&1 | tail -15
timeout 60 python3 -m benchmarks.quantbench device --shape tiny --requests 16 --batch 8 --sides oasr_fp16,oasr_int8,oasr_fp8 --json $OUT/cpuint8/quant_tiny.json 2>&1 | tail -12

# icefall (issue #16): GPU tests + benchmarks, <= 120 s on a fresh H200. Writes $OUT/icefall/.
# 1. GPU tests: CUDA == CPU == icefall (offline, streaming), greedy graph == eager, and NEW:
#    the opt-in streaming CUDA-graph step == the eager step (never run on a GPU yet).
timeout 45 python3 -m pytest -q -m gpu tests/icefall -p no:cacheprovider --timeout 40 2>&1 | tail -20 > $OUT/icefall/pytest_gpu.log
# 2. offline 64 x 30 s (+ per-module device seconds: --profile) and the eager streaming step at 16/64/128 streams
timeout 50 python3 -m benchmarks.icefallbench --device cuda --repeats 2 --streams 16,64,128 --stream-seconds 3.2 \
  --profile --json $OUT/icefall/icefallbench.json > $OUT/icefall/icefallbench.log 2>&1
# 3. (if time is left) the opt-in CUDA-graph streaming step: most streams held at p99 <= 100 ms
timeout 25 python3 -m benchmarks.icefallbench --device cuda --skip-offline --stream-graphs --find-max --streams 64 \
  --stream-seconds 3.2 --max-streams 1024 --json $OUT/icefall/icefallbench_graphs.json > $OUT/icefall/icefallbench_graphs.log 2>&1
# Expected: 1. all pass. 2. offline oasr_s below 0.883 s (equal-length batch: no padding masks; BiasNorm
#    5 kernels) with modules_s saying where the rest goes; streaming p99 well below the 241/248/231 ms
#    of before (host torch ops per step 3292 + 16 per stream -> 2388). 3. graph_replays > 0, max_streams_held >= 128.

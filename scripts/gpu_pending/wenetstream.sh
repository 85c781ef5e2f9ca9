# wenetstream (issue #20, WeNet medium streaming at scale). ~115 s on a warm H200.
# 1) 640 ms chunks. Expect: 1024 streams held (step p99 <= 100 ms; was 147.8 ms at 1024 in
#    benchmarks/results/h200_session6). --phases prints per run: host ms/step and us/row of
#    features, gather, encoder, wait (device time), search, scatter, results, finals (+ us per
#    final), scheduler; step-time p50/p99/max; the final updates' latency; GC collections.
timeout 50 python3 -m benchmarks.streambench --shape medium --device cuda --threads 4 --streams 1024,1280 \
  --seconds 6 --chunk-ms 640 --phases --json $OUT/wenetstream/s640.json 2>&1 | tail -12
# 2) 160 ms chunks. Expect: 320 held (step p99 <= 50 ms), as before or better (384 was 60.9 ms).
timeout 45 python3 -m benchmarks.streambench --shape medium --device cuda --threads 4 --streams 320,384 \
  --seconds 6 --chunk-ms 160 --phases --json $OUT/wenetstream/s160.json 2>&1 | tail -12
# 3) opt-in page-locked step inputs (OASR_STREAM_PINNED=1, never run on a GPU yet): graph == eager
#    with them; expect 2 passed. If it fails, the default (unpinned) path is unaffected.
OASR_STREAM_PINNED=1 timeout 20 python3 -m pytest -q -x -m gpu tests/engine/test_streaming_scale_gpu.py -k graph_step_equals_eager \
  -p no:cacheprovider 2>&1 | tail -5

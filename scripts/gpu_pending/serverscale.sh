# serverscale helper (issue #20, server part): 500 realtime WebSocket streams (10 s each, 100 ms
# pcm16 appends at 16 kHz, 4 client processes, phases spread over one 640 ms model chunk) + 32
# HTTP uploads (6 s WAVs) at once through a real `oasr-server --service-mode streaming
# --stream-batch-wait-ms 5` on the H200 (WeNet medium shape, random weights, float32: in fp16
# near-tied CTC argmaxes of random weights flip with the GEMM shapes, and the reference steps all
# 500 streams at once while the server steps ~10-30, so fp16 cannot tell whether the server path
# is exact; the step is host-bound either way); every final
# and every delta checked against the in-process streaming engine; one unmeasured warm-up round
# first. The server captures its streaming CUDA graphs while it warms up (every batch bucket up
# to 512 x history buckets up to 1024 frames; cache pool sized for 508 streams), so ~85 s
# expected (server start ~30 s, 2 rounds ~12 s each).
# Run of 2026-12-02 (before the fixes): FAILED. A graph capture hit torch's "use_count > 0"
# graph-pool assertion after the cache pool grew (GraphSteps reused the pool handle of graphs it
# had dropped), every later step ran eagerly at other shapes than the reference's graphs: finals
# 328/500, ~400 streams per step at ~0.7 s each, partial p99 1661 ms, 320 us of server CPU per
# append event (event loop 10.4 s of 13.6 s).
# Run of 2026-12-02 after the fixes (float32; results in docs/benchmarks.md, eighth session):
# 128 graphs captured ahead in 6.9 s, none while serving (643 replays), partial p99 119.6 ms,
# final p99 122 ms, uploads 32/32, leftovers 0, 276 us server CPU per append; finals 445/500:
# of 16 re-run one stream per step, 12 give the server's text (batch-shape numerics), 4 the
# reference's. Since then (serverfinals): the check is well-posed. On the CPU, batch composition
# moves the medium shape's logits by <= 3.4e-6 of their spread and changed 0/32 finals; the
# random head has 0.4 % of its frames within 1e-3 of the spread, so the H200's rounding flips
# some. A sharper or blank-dominant random head does not remove such ties (the noise scales with
# the logits) and a smoother one misses a dropped 100 ms piece in 9/24 streams, so the benchmark
# now steps each differing stream again in-process and passes its final only when the model's
# logits reach it by choices among tokens tied within 5e-3 of the spread (tie_margins in the
# JSON; a dropped piece needs 0.10-0.35).
# Run of 2026-12-02, ninth session (float32, after load_model turned cuDNN's TF32 off for float32
# models): finals 500/500 and uploads 32/32 EQUAL (0 tied): TF32 convolutions choosing their
# algorithm per batch shape were the cause. Partial p99 262.7 ms (p50 20.6), final p99 188 ms:
# the true-float32 convolutions cost the latency target. NEXT: the float16 run below (the serving
# precision, tie tolerance 3e-2) for p99 <= 150 ms; then, if p99 misses, a profile of one step.
# Expect: a "captured ahead" server log line and no "capture failed"; "CUDA graphs captured
# 0" in the measured round; finals equal + tied = 500/500, every tie_margin <= 5e-3 (None would
# be a real server difference: ordering, dropped/duplicated audio, final flush), uploads
# 32/32, leftovers 0; target partial p99 <= 150 ms. If p99 misses: server_loop_cpu_s near
# wall_s (event loop is the limit), server_steps.mean_batch, and --server-switch-interval-ms
# (the server sets 1 ms by default).
mkdir -p $OUT/serverscale
timeout 115 python3 -m benchmarks.serverstreambench --shape medium --device cuda --threads 4 \
  --streams 500 --seconds 10 --chunk-ms 100 --uploads 32 --clients 4 --batch-wait-ms 5 \
  --dtype float16 --log-level info --json $OUT/serverscale/serverstream_500_fp16.json \
  > $OUT/serverscale/serverstream_500_fp16.log 2>&1
echo "serverstreambench rc=$?"; tail -40 $OUT/serverscale/serverstream_500_fp16.log
timeout 20 python3 -m pytest -q -p no:cacheprovider -m gpu tests/server/test_stream_graphs_gpu.py \
  > $OUT/serverscale/pytest_gpu.log 2>&1
echo "pytest rc=$?"; tail -15 $OUT/serverscale/pytest_gpu.log

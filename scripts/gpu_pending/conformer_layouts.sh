# Pending H200 checks after the ninth session (issues #23, #17/#20). ~90 s.
# 1. Which CUDA layout change slowed WeNet (conformer_layouts.py docstring): expect one of
#    conv_module_*_gemm_ms / subsampling_*_channels_last_ms above its counterpart; land the other.
# 2. Nemotron streaming after the attention and causal-convolution changes: 512 streams ran at
#    step p99 80.5 ms (the only count tried); find the maximum.
mkdir -p $OUT/layouts
timeout 60 python3 scripts/gpu_pending/conformer_layouts.py > $OUT/layouts/layouts.json 2>&1
echo "layouts rc=$?"; cat $OUT/layouts/layouts.json
timeout 120 python3 -m benchmarks.nemobench --device cuda --kinds none --streams 512 --find-max \
  --max-streams 1536 --time-budget 100 --json $OUT/layouts/nemotron_findmax.json > $OUT/layouts/nemotron.log 2>&1
echo "nemotron rc=$?"; grep -E '"(streams|p99_ms|real_time)"|max_streams_held' -A1 $OUT/layouts/nemotron_findmax.json | head -30

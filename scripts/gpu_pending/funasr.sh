# funasr helper (issue #18): Paraformer-large speed + FunASR parity on the H200 (next session)
# 1) GPU tests (parity, fp16, CUDA graphs == eager); 2) opt-in CUDA graphs (also times eager and
# compares texts); 3) default path with FunASR and a profile; 4) word timestamps path.
mkdir -p $OUT/funasr
timeout 45 python3 -m pytest -q -m gpu tests/funasr -p no:cacheprovider 2>&1 | tail -15 > $OUT/funasr/pytest_gpu.log; tail -5 $OUT/funasr/pytest_gpu.log
timeout 30 python3 -m benchmarks.funasrbench --device cuda --batch 64 --repeats 5 --graphs --no-funasr \
  --json $OUT/funasr/funasrbench_graphs.json > $OUT/funasr/funasrbench_graphs.log 2>&1; echo "graphs rc=$?"
timeout 45 python3 -m benchmarks.funasrbench --device cuda --batch 64 --repeats 3 --profile \
  --json $OUT/funasr/funasrbench.json > $OUT/funasr/funasrbench.log 2>&1; echo "funasrbench rc=$?"
grep -hE '"(oasr_seconds|oasr_engine_seconds|oasr_eager_seconds|funasr_seconds|speedup_vs_funasr|engine_speedup_vs_funasr|texts_equal_eager|captures|replays|disabled|features_s|encoder_predictor_s|cif_decoder_rest_s)"' $OUT/funasr/*.json
# if time remains (~40 s): the word-timestamp path beside FunASR's output_timestamp=True
# timeout 50 python3 -m benchmarks.funasrbench --device cuda --batch 64 --repeats 3 --timestamps --graphs --json $OUT/funasr/funasrbench_ts.json > $OUT/funasr/funasrbench_ts.log 2>&1

# Pending H200 check (issue #21): the fused WFST kernel at 256 (today's default), 512 and 1024
# threads per block on the realistic graph at batch 64 (one block per utterance leaves 68 of
# 132 SMs idle; more threads per block split each frame's frontier finer). ~120 s; needs the
# pocketsphinx wheel folder (.whl-lm) and kaldi-decoder for the reference.
# Expect: same_words_as_kaldi 64/64 for every variant; if 512 or 1024 is faster, make it
# fused.THREADS and rerun `OASR_WFST_FUSED_THREADS=<n> pytest -m gpu tests/wfst`.
mkdir -p $OUT/wfst_threads
timeout 170 python3 -m benchmarks.wfstbench --device cuda --fused --no-tensor --fused-threads 512,1024 \
  --repeats 2 --out $OUT/wfst_threads/wfstbench.json > $OUT/wfst_threads/log.txt 2>&1
echo "rc=$?"; grep -E '"(seconds|rtfx|speedup|same_words|same_words_as_kaldi)"|fused_' $OUT/wfst_threads/log.txt | head -30

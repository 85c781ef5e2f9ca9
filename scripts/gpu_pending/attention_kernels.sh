#!/usr/bin/env bash
# lead: the decode-attention kernels after the shared block softmax (996abd6): their GPU parity
# tests (paged fp16/bf16/fp32, paged fp8, cross fp8) and the fused kernels.
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
  tests/kernels tests/quantization/test_cross_kv_fp8_gpu.py tests/quantization/test_gpu.py -k "paged or cross or attention or fp8" 2>&1 | tail -15

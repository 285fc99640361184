#!/usr/bin/env bash
# Thirty-fifth H200 call: the LFU expert cache (--moe-cache-policy lfu) on the GPU. Its kernels' GPU tests and
# the backends' greedy tests (both policies), then one process alternating plain hybrid with hybrid+lfu on the
# same banks at a third cached, then banks allocated side by side (is placement why whole servers differ?).
source scripts/gpu_prelude.sh
step gpu-tests; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_ensure_experts.py \
  tests/kernels/test_ensure_experts_hybrid.py tests/engine/moe 2>&1 | grep -E "^E |FAILED|passed|failed" | head -20
build
ceilings 35
C=hybrid+lru,hybrid+lfu  # (written `hybrid` when lru was the default)
step one-process; timeout 240 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs $C,$C,$C \
  --json $OUT/split35.json 2>&1 | grep -vE "INFO|building|it/s|config/s" | tail -10
step placement; timeout 90 python3 -m benchmarks.bench_cpu_stream --pages huge --prefetch 4096:l2 --allocations 6 \
  --rounds 2 --json $OUT/stream35.json 2>&1 | grep -vE "it/s" | tail -12

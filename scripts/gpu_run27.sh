#!/usr/bin/env bash
# Twenty-seventh H200 call (diagnostic): the GPU test that failed in run 26, and whether chained steps queue ahead
# (scripts/probe_overlap.py: launch/collect times on the model thread, synchronizing calls inside them).
source scripts/gpu_prelude.sh
build
step gpu-tests; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/runtime/test_batching.py \
  tests/engine/moe/test_cpu_executor.py -k "cuda or confine or handoff" 2>&1 | grep -E "^E |Error|FAILED|passed|failed" | head -30
step probe-resident; timeout 120 python3 scripts/probe_overlap.py 'synthetic:qwen3-30b-a3b?layers=4' resident 2>&1 | grep -v INFO | tail -12
step probe-hybrid; timeout 200 python3 scripts/probe_overlap.py 'synthetic:qwen3-30b-a3b?layers=24' hybrid moe_cache_rate=0.33 2>&1 | grep -v INFO | tail -12

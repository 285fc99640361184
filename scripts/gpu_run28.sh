#!/usr/bin/env bash
# Twenty-eighth H200 call: run 27 found every chained launch waiting out the step before it (a sampler index read
# on the host); with that gone: the probe again, then hybrid servers alternating A (decode overlap, the defaults)
# and C (--decode-overlap off, TANDEM_CPU_CONFINE=0: the path before this session), then auto, cpu and offload.
source scripts/gpu_prelude.sh
build
step gpu-tests; timeout 120 python3 -m pytest -q -p no:cacheprovider tests/engine/runtime tests/engine/moe/test_cpu_executor.py \
  -k "cuda or confine or handoff or sampl" 2>&1 | grep -E "^E |FAILED|passed|failed" | head -10
ceilings 28
step probe-hybrid; timeout 150 python3 scripts/probe_overlap.py "$M24" hybrid moe_cache_rate=0.33 2>&1 | grep -v INFO | grep -v building | tail -8
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits28.json --json $OUT/decode_run28.jsonl"
for i in 1 2 3; do
  step "round $i A"; timeout 75 $BENCH --backend hybrid --log-dir runs/a_$i 2>&1 | row
  if [ $i -lt 3 ]; then step "round $i C"; TANDEM_CPU_CONFINE=0 timeout 75 $BENCH --backend hybrid --server-arg=--decode-overlap=off --log-dir runs/c_$i 2>&1 | row; fi
done
step others; timeout 200 $BENCH --backend auto,cpu,offload --log-dir runs/others 2>&1 | row
grep -h "auto verdict" runs/others/serve-*.log | cut -c1-200

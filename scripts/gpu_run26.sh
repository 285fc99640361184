#!/usr/bin/env bash
# Twenty-sixth H200 call: decode overlap with the engine thread sleeping on each step's tokens while the next step
# runs, and the process's threads kept off the CPU executor's worker cores (TANDEM_CPU_CONFINE). Alternating
# hybrid servers: A = both (the new defaults), B = overlap without confinement, C = neither (no overlap).
source scripts/gpu_prelude.sh
build
step gpu-tests; timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/engine/runtime/test_batching.py \
  tests/engine/moe/test_cpu_executor.py -k "cuda or confine or handoff" 2>&1 | tail -2
ceilings 26
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits26.json --json $OUT/decode_run26.jsonl"
for i in 1 2 3; do
  step "round $i A"; timeout 75 $BENCH --backend hybrid --log-dir runs/a_$i 2>&1 | row
  step "round $i B"; TANDEM_CPU_CONFINE=0 timeout 75 $BENCH --backend hybrid --log-dir runs/b_$i 2>&1 | row
  if [ $i -lt 3 ]; then step "round $i C"; TANDEM_CPU_CONFINE=0 timeout 75 $BENCH --backend hybrid --server-arg=--decode-overlap=off --log-dir runs/c_$i 2>&1 | row; fi
done
grep -h "other threads\|split settled" runs/a_1/serve-*.log | cut -c1-220 | head -3

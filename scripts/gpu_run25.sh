#!/usr/bin/env bash
# Twenty-fifth H200 call: decode overlap (the engine launches step N+1, fed by step N's samples on the device,
# before it reads step N's tokens). GPU tests of the engine against transformers with graphs and chaining, the
# ceilings, then end to end: hybrid servers alternating --decode-overlap auto (new default) and off, and resident.
source scripts/gpu_prelude.sh
build
step gpu-tests; timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/runtime 2>&1 | tail -3
ceilings 25
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits25.json --json $OUT/decode_run25.jsonl"
for i in 1 2 3; do
  step "round $i overlap"; timeout 75 $BENCH --backend hybrid --log-dir runs/ov_$i 2>&1 | row
  step "round $i off"; timeout 75 $BENCH --backend hybrid --server-arg=--decode-overlap=off --log-dir runs/off_$i 2>&1 | row
done
step resident; timeout 60 $BENCH --backend resident --log-dir runs/res 2>&1 | row
grep -h "chained\|split settled" runs/ov_1/serve-*.log | cut -c1-200 | head -3

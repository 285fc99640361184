#!/usr/bin/env bash
# Thirty-third H200 call: end to end with the one-row GEMV kernel (run 32): resident, hybrid and auto at a third
# cached, then the cache-share sweep of offload and hybrid for the plot (rows appended as they finish).
source scripts/gpu_prelude.sh
build
ceilings 33
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits33.json --json $OUT/decode_run33.jsonl"
step resident; timeout 60 $BENCH --backend resident --log-dir runs/r 2>&1 | row
step "a third cached"; timeout 130 $BENCH --cache-rate 0.33 --backend hybrid --repeat 3 --log-dir runs/t 2>&1 | row
timeout 100 $BENCH --cache-rate 0.33 --backend auto,offload --log-dir runs/t 2>&1 | row
step sweep; timeout 200 $BENCH --cache-rate 0.2,0.5 --backend hybrid,offload --log-dir runs/s 2>&1 | row

#!/usr/bin/env bash
# Thirty-ninth H200 call: the cache-share sweep of hybrid and offload again with lfu (the new default), for the plot.
source scripts/gpu_prelude.sh
build
ceilings 39
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --decode-tokens 128 --warmup-tokens 384 --warmup-prompt-index 1
  --startup-timeout 100 --ceilings $OUT/physlimits39.json --json $OUT/decode_run39.jsonl --server-arg=--moe-cache-policy=lfu"
step sweep; timeout 200 $BENCH --cache-rate 0.2,0.5 --backend hybrid,offload --log-dir runs/s 2>&1 | row

#!/usr/bin/env bash
# Thirty-eighth H200 call: lfu won 7 of 9 one-process pairs (runs 35, 37) and becomes the default. Auto against
# hybrid, both with lfu, alternating servers: is auto within 5 % of the best backend, is hybrid at >= 90?
# (Run with --moe-cache-policy passed explicitly, the same as the new default.)
source scripts/gpu_prelude.sh
build
ceilings 38
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --warmup-prompt-index 1 --startup-timeout 100 --ceilings $OUT/physlimits38.json --json $OUT/decode_run38.jsonl
  --server-arg=--moe-cache-policy=lfu"
for i in 1 2 3; do
  step "round $i auto"; timeout 80 $BENCH --backend auto --log-dir runs/a_$i 2>&1 | row
  step "round $i hybrid"; timeout 75 $BENCH --backend hybrid --log-dir runs/h_$i 2>&1 | row
done
fields "$OUT/decode_run38.jsonl" backend cache_policy decode_tok_s fetch_fraction auto worker_preemptions

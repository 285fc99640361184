#!/usr/bin/env bash
# Thirty-sixth H200 call: run 35's one process had lfu ahead in two rounds of three (8 % fewer misses). Whole
# servers now, hybrid with lru (then the default) and with lfu alternating, warmed up on another prompt than the one
# measured (a warm-up on the measured prompt would hand lfu the very counts it then replays), then auto with lfu.
source scripts/gpu_prelude.sh
build
ceilings 36
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --warmup-prompt-index 1 --startup-timeout 100 --ceilings $OUT/physlimits36.json --json $OUT/decode_run36.jsonl"
for i in 1 2 3; do
  step "round $i lru"; timeout 75 $BENCH --backend hybrid --server-arg=--moe-cache-policy=lru --log-dir runs/l_$i 2>&1 | row
  step "round $i lfu"; timeout 75 $BENCH --backend hybrid --server-arg=--moe-cache-policy=lfu --log-dir runs/f_$i 2>&1 | row
done
step "auto lfu"; timeout 100 $BENCH --backend auto --server-arg=--moe-cache-policy=lfu --log-dir runs/a 2>&1 | row
fields "$OUT/decode_run36.jsonl" backend cache_policy decode_tok_s miss_rate fetch_fraction worker_preemptions output_sha1

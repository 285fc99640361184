#!/usr/bin/env bash
# Thirty-seventh H200 call: servers in run 36 ranged 74-103 tok/s for one config, so the lfu/lru question goes
# back to one process (same banks, same placement) with six rounds, and servers alternate again in the other
# order (lfu first) so drift over the call does not favour one. Then auto with the default policy. First the
# three interpreter-only tests that run 35 found running (and failing) on CUDA: they now skip there.
source scripts/gpu_prelude.sh
step interpreter-tests; timeout 60 python3 -m pytest -q -p no:cacheprovider tests/engine/moe -rs \
  -k "posted_row or under_the_interpreter or offload_with_triton" 2>&1 | grep -E "SKIP|passed|failed|skipped" | head
build
ceilings 37
C=hybrid+lfu,hybrid+lru  # (written `hybrid` when lru was the default)
step one-process; timeout 200 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs $C,$C,$C,$C,$C,$C \
  --json $OUT/split37.json 2>&1 | grep -vE "INFO|building|it/s|config/s" | tail -14
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --warmup-prompt-index 1 --startup-timeout 100 --ceilings $OUT/physlimits37.json --json $OUT/decode_run37.jsonl"
for i in 1 2 3; do
  step "round $i lfu"; timeout 75 $BENCH --backend hybrid --server-arg=--moe-cache-policy=lfu --log-dir runs/f_$i 2>&1 | row
  step "round $i lru"; timeout 75 $BENCH --backend hybrid --server-arg=--moe-cache-policy=lru --log-dir runs/l_$i 2>&1 | row
done
step "auto lru"; timeout 90 $BENCH --backend auto --server-arg=--moe-cache-policy=lru --log-dir runs/a 2>&1 | row
fields "$OUT/decode_run37.jsonl" backend cache_policy decode_tok_s fetch_fraction worker_preemptions

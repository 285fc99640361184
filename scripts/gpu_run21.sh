#!/usr/bin/env bash
# Twenty-first H200 call (run 20's machine and ceilings): end to end through the OpenAI API, hybrid servers
# alternating the new host memory path (banks in 2 MiB pages pinned in place, executor prefetch 4096:l2, the
# defaults now) with the old one (the kernel's 4 KiB pages, prefetch 2048:l1), then the new one with the warm.
source scripts/gpu_prelude.sh
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --backend hybrid --cache-rate 0.33 --decode-tokens 128
  --warmup-tokens 384 --startup-timeout 100 --ceilings docs/results/h200-2026-11-29/physlimits20.json --json $OUT/decode_run21.jsonl"
build
for i in 1 2 3; do
  step "round $i new"; timeout 75 $BENCH --log-dir runs/new_$i 2>&1 | grep -E "^ +hybrid"
  step "round $i old"; TANDEM_HOST_HUGE_PAGES=0 TANDEM_CPU_PREFETCH=2048:l1 timeout 75 $BENCH --log-dir runs/old_$i 2>&1 | grep -E "^ +hybrid"
done
step "new, warm 4"; timeout 75 $BENCH --server-arg=--moe-cpu-warm=4 --log-dir runs/new_w4 2>&1 | grep -E "^ +hybrid"
grep -h "split settled\|banks pinned\|host banks\|stream prefetch" runs/*/serve-*.log | cut -c1-260
tar czf $OUT/serve_logs21.tgz runs/ 2>/dev/null

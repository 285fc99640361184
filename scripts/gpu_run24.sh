#!/usr/bin/env bash
# Twenty-fourth H200 call (run 23's machine and ceilings): end to end, the engine thread sleeping on a blocking
# CUDA event for each step's tokens (TANDEM_HOST_WAIT=block, new default) against spinning (the runtime's
# default), alternating hybrid servers; then 14 executor workers; then the other backends for the issue table.
source scripts/gpu_prelude.sh
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings docs/results/h200-2026-11-29/physlimits23.json --json $OUT/decode_run24.jsonl"
build
step gpu-tests; timeout 60 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/runtime/test_sampler.py 2>&1 | tail -1
for i in 1 2 3; do
  step "round $i block"; timeout 70 $BENCH --backend hybrid --log-dir runs/block_$i 2>&1 | row
  step "round $i spin"; TANDEM_HOST_WAIT=spin timeout 70 $BENCH --backend hybrid --log-dir runs/spin_$i 2>&1 | row
done
step "14 workers"; timeout 140 $BENCH --backend hybrid --repeat 2 --server-arg=--moe-cpu-threads=14 --log-dir runs/t14 2>&1 | row
step others; timeout 200 $BENCH --backend resident,offload,cpu,auto --log-dir runs/others 2>&1 | row
grep -h "auto verdict" runs/others/serve-*.log | cut -c1-200

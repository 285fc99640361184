#!/usr/bin/env bash
# (Ran at commit e686bdf; TANDEM_CPU_ISOLATE was removed after this run showed no effect: docs/benchmarks.md run 18.)
# Eighteenth H200 call (a fresh machine: no ceilings measured in this call): does keeping the server's own threads
# off the executor workers' cores (TANDEM_CPU_ISOLATE=1) remove the server-to-server spread of hybrid
# (run 17: 72.0-81.6 tok/s plain)? Eight servers alternating isolated / not, end to end, then one with
# --moe-cpu-warm 4 isolated.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run18.jsonl"
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
for i in 1 2 3 4; do
  for iso in 1 0; do
    step "decode24 round $i isolate $iso"; TANDEM_CPU_ISOLATE=$iso timeout 70 $BENCH --model "$M24" --backend hybrid \
       --cache-rate 0.33 --decode-tokens 128 --log-dir runs/bench_decode_${i}_i$iso 2>&1 | grep -E "^ +hybrid"
  done
done
step "decode24 isolate warm 4"; timeout 70 $BENCH --model "$M24" --backend hybrid --cache-rate 0.33 --decode-tokens 128 \
   --server-arg=--moe-cpu-warm=4 --log-dir runs/bench_decode_w4 2>&1 | grep -E "^ +hybrid"
grep -h "split settled\|other threads" runs/bench_decode*/serve-*.log | cut -c1-220
tar czf $OUT/serve_logs18.tgz runs/bench_decode* 2>/dev/null

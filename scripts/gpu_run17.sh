#!/usr/bin/env bash
# Seventeenth H200 call (same machine as runs 15-16, run 15's ceilings): end to end through the OpenAI API,
# eight hybrid servers alternating plain / --moe-cpu-warm 4, to see the effect through the server-to-server
# spread (runs 9-16: 63-78 tok/s for the same plain hybrid server).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run17.jsonl"
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
for i in 1 2 3 4; do
  for w in 0 4; do
    step "decode24 round $i warm $w"; timeout 70 $BENCH --model "$M24" --backend hybrid --cache-rate 0.33 --decode-tokens 128 \
       --server-arg=--moe-cpu-warm=$w --log-dir runs/bench_decode_${i}_w$w 2>&1 | grep -E "^ +hybrid"
  done
done
grep -h "split settled\|captured" runs/bench_decode*/serve-*.log | cut -c1-200
tar czf $OUT/serve_logs17.tgz runs/bench_decode* 2>/dev/null

#!/usr/bin/env bash
# Sixteenth H200 call (same machine as run 15, its ceilings): --moe-cpu-warm again, configs interleaved so
# that drift within the process shows (run 15's first hybrid ran at 64.8 tok/s, its last at 72.2), then end
# to end through the OpenAI API: hybrid with warm 2, plain hybrid, hybrid with warm 2, auto with warm 2.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
show() { grep -v "server/s\]" | tail -7; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step split; timeout 200 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 \
   --configs hybrid,hybrid+w2,hybrid+w3,hybrid+w4,hybrid,hybrid+w2,hybrid+w3,hybrid \
   --json $OUT/split16.json > $OUT/split16.log 2>&1; echo "rc $?"
grep -v "it/s\]\|config/s\]\|s/config\]" $OUT/split16.log | grep -iE "error|Traceback|failed|capture" | head -5
sed -n '/slots (/,$p' $OUT/split16.log
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run16.jsonl"
for run in w2:hybrid:2 plain:hybrid:0 w2b:hybrid:2 autow2:auto:2; do
  IFS=: read name backend w <<< "$run"
  step "decode24 $name"; timeout 100 $BENCH --model "$M24" --backend $backend --cache-rate 0.33 --decode-tokens 128 \
     --server-arg=--moe-cpu-warm=$w --log-dir runs/bench_decode_$name 2>&1 | show
done
grep -h "split settled\|capture\|auto verdict" runs/bench_decode*/serve-*.log | cut -c1-300
tar czf $OUT/serve_logs16.tgz runs/bench_decode* 2>/dev/null

#!/usr/bin/env bash
# Thirteenth H200 call: the tuner judging windows by their median step (run 12: the mean chased occasional
# slow steps, settling at f 0.22-0.375 and 64-77 tok/s). End to end through the OpenAI API on the 24-layer cut
# at a third cached (hybrid twice, to see the spread), offload with --moe-prefetch 1, the full 48 layers.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
show() { grep -v "server/s\]" | tail -7; }
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run13.jsonl"
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits13.txt 2>&1); grep -E "GBs" $OUT/physlimits13.txt | head -24
step decode24; timeout 230 $BENCH --model "$M24" --backend hybrid,offload,auto,hybrid --cache-rate 0.33 --decode-tokens 128 2>&1 | show
grep -h "auto verdict\|split settled" runs/bench_decode/serve-*.log | cut -c1-400
step decode24-offload-prefetch1; timeout 60 $BENCH --model "$M24" --backend offload --cache-rate 0.33 --decode-tokens 128 \
   --server-arg=--moe-prefetch=1 --log-dir runs/bench_decode_p1 2>&1 | show
step decode48; timeout 100 $BENCH --model synthetic:qwen3-30b-a3b --backend hybrid --gpu-memory-limit 24 --decode-tokens 64 \
   --log-dir runs/bench_decode48 2>&1 | show
grep -h "split settled" runs/bench_decode48/serve-*.log | cut -c1-400
tar czf $OUT/serve_logs13.tgz runs/bench_decode* 2>/dev/null

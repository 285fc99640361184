#!/usr/bin/env bash
# Twenty-fifth H200 call (the session's last device minutes): the full 48-layer geometry at a 24 GiB cap with
# the split decode attention and huge-page banks (hybrid), and auto once more on the 24-layer cut.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 90 --json $OUT/decode_run25.jsonl"
row() { grep -E "^ +(hybrid|offload|auto) "; }
step build; timeout 60 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step decode48; timeout 85 $BENCH --model synthetic:qwen3-30b-a3b --backend hybrid --gpu-memory-limit 24 --decode-tokens 64 \
   --log-dir runs/d48 2>&1 | row
step auto24; timeout 60 $BENCH --model 'synthetic:qwen3-30b-a3b?layers=24' --backend auto --cache-rate 0.33 --decode-tokens 128 \
   --log-dir runs/auto 2>&1 | row
grep -h "auto verdict\|banks pinned" runs/*/serve-*.log | cut -c1-200

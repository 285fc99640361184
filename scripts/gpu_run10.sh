#!/usr/bin/env bash
# Tenth H200 call (the session's last device minutes): ceilings, then offload, hybrid and auto end to end on the
# 24-layer cut with a third of the experts cached (the issue-8 comparison point).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 60 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step physlimits; (cd .tools && timeout 60 python3 physlimits.py > $OUT/physlimits10.txt 2>&1); grep -E "GBs" $OUT/physlimits10.txt | head -24
step decode24; timeout 150 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend offload,hybrid,auto --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384 --startup-timeout 60 \
   --json $OUT/decode_run10.jsonl 2>&1 | grep -v "server/s\]" | tail -5
grep -h "auto verdict" runs/bench_decode/serve-auto*.log | cut -c1-300

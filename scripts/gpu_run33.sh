#!/usr/bin/env bash
# Thirty-third H200 call: end to end with the one-row GEMV kernel (run 32): resident, hybrid and auto at a third
# cached, then the cache-share sweep of offload and hybrid for the plot (rows appended as they finish).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
row() { grep -E "^ +(resident|hybrid|offload|cpu|auto) "; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits33.txt 2>&1); grep -E "GBs" $OUT/physlimits33.txt | grep -E "h2d_gather_8|overlap|c_avx512_stream"
cp $OUT/physlimits.json $OUT/physlimits33.json
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits33.json --json $OUT/decode_run33.jsonl"
step resident; timeout 60 $BENCH --backend resident --log-dir runs/r 2>&1 | row
step "a third cached"; timeout 130 $BENCH --cache-rate 0.33 --backend hybrid --repeat 3 --log-dir runs/t 2>&1 | row
timeout 100 $BENCH --cache-rate 0.33 --backend auto,offload --log-dir runs/t 2>&1 | row
step sweep; timeout 200 $BENCH --cache-rate 0.2,0.5 --backend hybrid,offload --log-dir runs/s 2>&1 | row

#!/usr/bin/env bash
# Fifth H200 call: c_sync of the reworked handoff; offload on the full 48-layer geometry with the VRAM
# capped at 24 GiB; offload vs auto (which times offload and hybrid online and keeps the faster) on the
# 24-layer cut with a third of the experts cached.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step cpu-executor; timeout 40 python3 -m benchmarks.bench_cpu_executor --json $OUT/cpu_executor5.json 2>&1 | tail -6
step decode48; timeout 170 python3 -m benchmarks.bench_decode_moe --model synthetic:qwen3-30b-a3b \
   --backend offload --gpu-memory-limit 24 --decode-tokens 64 --startup-timeout 150 --json $OUT/decode48_run5.jsonl 2>&1 | tail -3
step decode24; timeout 170 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend offload,auto --cache-rate 0.33 --decode-tokens 128 --startup-timeout 100 --json $OUT/decode24_run5.jsonl 2>&1 | tail -4
grep -h "auto verdict\|auto: switching\|moe-backend auto ->" runs/bench_decode/serve-auto.log | cut -c1-400
grep -h "expert cache:" runs/bench_decode/serve-offload.log | head -2

#!/usr/bin/env bash
# Fifth H200 call: the reworked hybrid handoff (tests + c_sync) and the 24-layer end-to-end decode with a
# third of the experts cached: offload, hybrid and auto (which times both online and keeps the faster).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 75 python3 -m pytest -m gpu tests/engine/moe/test_cpu_executor.py tests/engine/moe/test_hybrid.py -q -p no:cacheprovider 2>&1 | tail -6 | tee $OUT/gpu_tests5.txt
step cpu-executor; timeout 40 python3 -m benchmarks.bench_cpu_executor --json $OUT/cpu_executor5.json 2>&1 | tail -7
step decode; timeout 200 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend offload,hybrid,auto --cache-rate 0.33 --decode-tokens 128 --startup-timeout 100 --json $OUT/decode24_run5.jsonl 2>&1 | tail -6
grep -h "auto verdict\|auto: switching" runs/bench_decode/serve-auto.log

#!/usr/bin/env bash
# Eighth H200 call: the split curve (fixed caps) against offload, cpu and the controller + tuner in one process;
# then offload, cpu, hybrid and auto end to end on the 24-layer cut, a third of the experts cached, with ceilings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 100 python3 -m pytest -m gpu tests/engine/moe/test_hybrid.py tests/engine/moe/test_auto.py -q -p no:cacheprovider 2>&1 | tail -3 | tee $OUT/gpu_tests8.txt
step physlimits; (cd .tools && timeout 120 python3 physlimits.py > $OUT/physlimits8.txt 2>&1); grep -E "GBs" $OUT/physlimits8.txt | head -24
step split; timeout 200 python3 -m benchmarks.bench_hybrid_split --configs offload,cpu,hybrid:1,hybrid:2,hybrid:3,hybrid \
   --json $OUT/split8.json --plot $OUT/split8.png 2>&1 | grep -v "it/s\]\|s/config\]" | tail -9
step decode24; timeout 230 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend offload,cpu,hybrid,auto --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 512 --startup-timeout 100 \
   --json $OUT/decode24_run8.jsonl 2>&1 | tail -5
grep -h "auto verdict\|auto: switching\|tuning it" runs/bench_decode/serve-*.log | cut -c1-300
tar czf $OUT/serve_logs8.tgz runs/bench_decode 2>/dev/null

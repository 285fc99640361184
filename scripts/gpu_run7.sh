#!/usr/bin/env bash
# Seventh H200 call: c_sync calibrated inside a graph; the split curve (fixed caps) against offload, cpu and
# the controller in one process (benchmarks/bench_hybrid_split.py); hybrid end to end again.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 120 python3 -m pytest -m gpu tests/engine/moe/test_hybrid.py -q -p no:cacheprovider 2>&1 | tail -4 | tee $OUT/gpu_tests7.txt
step split; timeout 240 python3 -m benchmarks.bench_hybrid_split --configs offload,cpu,hybrid:1,hybrid:2,hybrid:3,hybrid:5,hybrid \
   --json $OUT/split7.json --plot $OUT/split7.png 2>&1 | grep -v "it/s\]\|s/config\]" | tail -14
step decode24; timeout 150 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend hybrid --cache-rate 0.33 --decode-tokens 128 --startup-timeout 100 --json $OUT/decode24_run7.jsonl 2>&1 | tail -2
python3 -c "
import json
for line in open('$OUT/decode24_run7.jsonl'):
    r = json.loads(line); print(r['backend'], r.get('decode_tok_s'), r.get('event_ms_p50'), r.get('event_ms_p99'), r.get('miss_rate'), r.get('split'), r.get('error', '')[:300])
"

#!/usr/bin/env bash
# Third H200 call: GPU tests of the whole engine, a fresh profile, then the end-to-end decode benchmark
# (a real `tandem serve` per backend) on the 24-layer Qwen3-30B-A3B geometry with 1/3 of experts cached.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 200 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -2
step gpu-tests; timeout 240 python3 -m pytest -m gpu tests/kernels tests/engine tests/profiler/test_bench_bw.py -q -p no:cacheprovider 2>&1 | tail -15 | tee $OUT/gpu_tests3.txt
step bench-bw; timeout 120 python3 -m services.cli bench bw --model 'synthetic:qwen3-30b-a3b?layers=24' --seconds 2 2>&1 | tail -12
step decode; timeout ${DECODE_TIMEOUT:-300} python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend ${BACKENDS:-resident,offload,cpu,hybrid,auto} --cache-rate 0.33 --decode-tokens 128 --greedy --startup-timeout 150 \
   --json $OUT/decode24.jsonl 2>&1 | tail -20
for f in runs/bench_decode/*.log; do echo "--- $f"; grep -v "^\s*$" $f | grep -iE "error|warn|Traceback|ready|backend|graph|slots" | head -12; done
tar czf $OUT/serve_logs.tgz runs/bench_decode 2>/dev/null

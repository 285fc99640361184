#!/usr/bin/env bash
# Fifteenth H200 call: --moe-cpu-warm. GPU tests of the warm path (the plan inside the runner's captured
# decode graph, the split's preference in Triton), ceilings, then one process (bench_hybrid_split, the engine's
# runner and decode graphs) timing hybrid and cpu with and without warming, then end to end through the OpenAI
# API on the 24-layer cut at a third cached.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
show() { grep -v "server/s\]" | tail -7; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/moe/test_cpu_warm.py \
   tests/engine/moe/test_hybrid.py tests/kernels/test_ensure_experts_hybrid.py 2>&1 | tail -4
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits15.txt 2>&1); grep -E "GBs" $OUT/physlimits15.txt | head -24
step split; timeout 240 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 \
   --configs hybrid,hybrid+w1,hybrid+w2,hybrid+w4,hybrid+w8,cpu,cpu+w2,cpu+w4,hybrid \
   --json $OUT/split15.json > $OUT/split15.log 2>&1; echo "rc $?"
grep -v "it/s\]\|config/s\]\|s/config\]" $OUT/split15.log | grep -iE "error|Traceback|failed" | head -5
sed -n '/slots (/,$p' $OUT/split15.log
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run15.jsonl"
step decode24-warm; timeout 100 $BENCH --model "$M24" --backend hybrid --cache-rate 0.33 --decode-tokens 128 \
   --server-arg=--moe-cpu-warm=${WARM:-4} --log-dir runs/bench_decode_w 2>&1 | show
step decode24; timeout 100 $BENCH --model "$M24" --backend hybrid --cache-rate 0.33 --decode-tokens 128 2>&1 | show
grep -h "split settled\|cpu warm" runs/bench_decode*/serve-*.log | cut -c1-400
tar czf $OUT/serve_logs15.tgz runs/bench_decode* 2>/dev/null

#!/usr/bin/env bash
# Eleventh H200 call: the next-layer prefetch. GPU tests of its captured path, ceilings, then one process
# (bench_hybrid_split, the engine's runner and decode graphs) timing offload and hybrid with and without it,
# and hybrid with 14 CPU workers, on the 24-layer cut with a third of the experts cached.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/moe/test_prefetch.py \
   tests/kernels/test_prefetch_pick.py tests/kernels/test_ensure_experts.py 2>&1 | tail -4
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits11.txt 2>&1); grep -E "GBs" $OUT/physlimits11.txt | head -24
step split; timeout 300 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 \
   --configs offload,offload+p2,offload+p4,offload+p8,hybrid,hybrid+p1,hybrid+p2,hybrid+p4,hybrid+t14,hybrid+p2+t14 \
   --json $OUT/split11.json > $OUT/split11.log 2>&1; echo "rc $?"
grep -v "it/s\]\|config/s\]\|s/config\]" $OUT/split11.log | grep -iE "error|Traceback|failed" | head -5
sed -n '/slots (/,$p' $OUT/split11.log

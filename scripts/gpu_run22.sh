#!/usr/bin/env bash
# Twenty-second H200 call (run 20's machine): where a hybrid decode step's time goes. One process, the engine's
# runner and decode graphs: per layer the GPU side, the wait for the CPU, the serial part (CPU result in -> next
# job out) and the CPU's time per job, then the GPU kernels of 8 profiled steps per config.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step split; timeout 300 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs hybrid,cpu,offload,hybrid+w3 \
   --profile-steps 8 --json $OUT/split22.json > $OUT/split22.log 2>&1; echo "rc $?"
grep -v "it/s\]\|config/s\]\|s/config\]" $OUT/split22.log | grep -iE "error|Traceback|failed" | head -5
sed -n '/slots (/,$p' $OUT/split22.log

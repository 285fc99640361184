#!/usr/bin/env bash
# Second H200 call: build the CPU executor, GPU tests of the offload/cpu/hybrid path, ceilings, the kernel
# benchmarks and the bandwidth profile — all in one lease so every ratio uses same-run ceilings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=$OUT/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 240 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -5
step physlimits; (cd .tools && timeout 150 python3 physlimits.py > $OUT/physlimits.txt 2>&1); head -20 $OUT/physlimits.txt
step gpu-tests; timeout 200 python3 -m pytest -m gpu tests/kernels tests/engine/moe tests/profiler -q -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/gpu_tests2.txt
step cpu-executor; timeout 90 python3 -m benchmarks.bench_cpu_executor --json $OUT/cpu_executor.json 2>&1 | tail -25
step cache-copy; timeout 120 python3 -m services.cli bench cache-copy --modes fused,per-bank --json $OUT/cache_copy.json 2>&1 | tail -40
step bench-bw; timeout 150 python3 -m services.cli bench bw --model synthetic:qwen3-30b-a3b --dtype bfloat16 --seconds 2 --gpu 0 -o $OUT/profile-h200.json 2>&1 | tail -30
step compare; timeout 30 python3 -m services.profiler.compare $OUT/profile-h200.json $OUT/physlimits.json --json $OUT/compare.json 2>&1 | tail -20

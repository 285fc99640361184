#!/usr/bin/env bash
# Twentieth H200 call: host banks in their own mappings advised to 2 MiB pages and pinned in place
# (banks.host_bank), and the executor's software prefetch (TANDEM_CPU_PREFETCH). GPU tests of every path that
# reads the banks, ceilings, then the executor's stream per page size and prefetch, alone and beside the gather.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step host; grep -m1 "model name" /proc/cpuinfo; grep -i "hypervisor" /proc/cpuinfo | head -1 | cut -c1-20
cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 170 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/moe/test_banks.py \
   tests/engine/moe/test_cpu_executor.py tests/engine/moe/test_offload.py tests/engine/moe/test_hybrid.py \
   tests/engine/moe/test_prefetch.py tests/engine/moe/test_cpu_warm.py 2>&1 | tail -4
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits20.txt 2>&1); grep -E "GBs" $OUT/physlimits20.txt | head -24
step stream; timeout 200 python3 -m benchmarks.bench_cpu_stream --json $OUT/stream20.json 2>&1 | grep -v "trial/s\]\|s/trial\]"

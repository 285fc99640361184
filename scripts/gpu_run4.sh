#!/usr/bin/env bash
# Fourth H200 call: the fused decode step (resident, 48 layers) and a sampled end-to-end decode of the
# 24-layer geometry with a third of the experts cached (offload, auto), with ceilings from the same run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step physlimits; (cd .tools && timeout 150 python3 physlimits.py > $OUT/physlimits.txt 2>&1); grep -E "GBs" $OUT/physlimits.txt | head -20
step gpu-tests; timeout 150 python3 -m pytest -m gpu tests/kernels tests/engine/models tests/engine/runtime -q -p no:cacheprovider 2>&1 | tail -8 | tee $OUT/gpu_tests4.txt
step resident; timeout 150 python3 -m benchmarks.bench_resident_decode --tokens 64 --decode-kernels triton --json $OUT/resident_decode4.json 2>&1 | tail -8
step bench-bw; timeout 90 python3 -m services.cli bench bw --model 'synthetic:qwen3-30b-a3b?layers=24' --seconds 2 2>&1 | tail -6
step decode; timeout 240 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend resident,offload,auto --cache-rate 0.33 --decode-tokens 128 --startup-timeout 120 --json $OUT/decode24_sampled.jsonl 2>&1 | tail -8

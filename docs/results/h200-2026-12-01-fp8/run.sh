#!/usr/bin/env bash
# Issue 21 on the H200: the GPU tests of the FP8 kernels, ceilings, then FP8 vs bf16 (CPU executor, hybrid at
# 1/3 cached, resident) on synthetic:qwen3-30b-a3b?layers=24, and online quantization's error. All in $OUT.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
git log --oneline -1 | cat; ls services/engine/moe/fp8.py; nproc
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_gemv_fp8.py \
  "tests/engine/models/test_fp8_checkpoint.py::test_cuda_backends_equal_transformers" > $OUT/gpu_tests.txt 2>&1; tail -6 $OUT/gpu_tests.txt
step ceilings; timeout 40 python3 -m benchmarks.ceilings --overlap-seconds 2 --json $OUT/ceilings.json 2>&1 | tail -12
step cpu-executor
for dt in fp8 bfloat16; do
  timeout 35 python3 -m benchmarks.bench_cpu_executor --dtype $dt --layers 4 --rounds 3 --trial-seconds 0.3 --read-mib 512 \
    --json $OUT/cpu_exec_$dt.json 2>&1 | grep -E "isa|ceiling|executor" | head -4
done
step hybrid
for dt in fp8 checkpoint; do
  timeout 100 python3 -m benchmarks.bench_hybrid_split --model "$M24" --moe-expert-dtype $dt --cache-rate 0.33 \
    --configs offload,hybrid --warmup 128 --tokens 64 --max-seq-len 320 --json $OUT/hybrid_$dt.json 2>&1 \
    | grep -vE "it/s|layer/s|config/s|s/it" | tail -6
done
step resident
for dt in fp8 checkpoint; do
  timeout 60 python3 -m benchmarks.bench_resident_decode --model "$M24" --moe-expert-dtype $dt --decode-kernels triton \
    --tokens 64 --warmup 8 --max-seq-len 256 --json $OUT/resident_$dt.json 2>&1 | grep -vE "it/s|layer/s" | tail -4
done
step quant-error
timeout 60 python3 -m benchmarks.fp8_quant_error --model "$M24" --device cuda --prompts 6 --tokens 16 2>/dev/null | tee $OUT/quant_error.json
step done

#!/usr/bin/env bash
# Thirty-second H200 call: the one-row GEMV kernel (kernels/gemv.py) for the serial part's q/k/v, o_proj and
# router: GPU tests (kernel, the fused decode step in a graph, the models against their references), then its
# block sweep against cuBLAS, replayed from CUDA graphs as decode runs them.
source scripts/gpu_prelude.sh
step gpu-tests; timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_fused_decode.py \
  tests/engine/models 2>&1 | grep -E "^E |FAILED|passed|failed" | head -20
step sweep; timeout 300 python3 -m benchmarks.bench_gemv --json $OUT/gemv32.json 2>&1 | grep -v "it/s"

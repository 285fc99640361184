#!/usr/bin/env bash
# Nineteenth H200 call (the session's last device minutes): GPU tests of the prefill GEMV path (the kernel at a
# 132-token prefill, resident and offload against their references), then time-to-first-token end to end.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step gpu-tests; timeout 80 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_moe_gemv.py \
   tests/engine/models/test_resident.py tests/engine/moe/test_offload.py 2>&1 | tail -3
step ttft; timeout 110 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' --backend resident,offload \
   --cache-rate 0.33 --decode-tokens 32 --warmup-tokens 16 --startup-timeout 60 --json $OUT/decode_run19.jsonl 2>&1 | grep -v "server/s\]" | tail -4

#!/usr/bin/env bash
# Thirty-fourth H200 call: the full 48-layer geometry again (last measured in runs 12-13, before decode overlap and
# the one-row GEMV): hybrid and offload with the VRAM capped at 24 GiB, then resident.
source scripts/gpu_prelude.sh
build
ceilings 34
BENCH="python3 -m benchmarks.bench_decode_moe --model synthetic:qwen3-30b-a3b --decode-tokens 64 --warmup-tokens 384
  --startup-timeout 150 --ceilings $OUT/physlimits34.json --json $OUT/decode48_run34.jsonl"
step "48 layers, 24 GiB"; timeout 200 $BENCH --gpu-memory-limit 24 --backend hybrid,offload --log-dir runs/g 2>&1 | row
step resident; timeout 90 $BENCH --backend resident --log-dir runs/r 2>&1 | row

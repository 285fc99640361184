#!/usr/bin/env bash
# Thirty-first H200 call: run 30 put hybrid's parallel phase at ~96 % of the concurrent DRAM ceiling, so what is
# left is the serial part of each layer (~63 us, DRAM idle). One process, configs alternating (same banks, same
# memory placement): plain hybrid against using that idle time for the next layer's predicted experts, read into
# the CPU's caches (+w1, --moe-cpu-warm 1), copied ahead over PCIe (+p1, --moe-prefetch 1), or both.
source scripts/gpu_prelude.sh
step topology; lscpu | grep -iE "model name|numa|^L[23]|socket"; ls /sys/devices/system/node | grep node
build
ceilings 31
C=hybrid,hybrid+w1,hybrid+p1,hybrid+p1+w1
step one-process; timeout 400 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs $C,$C --json $OUT/split31.json 2>&1 \
  | grep -vE "INFO|building|it/s|config/s" | tail -12

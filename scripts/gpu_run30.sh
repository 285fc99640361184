#!/usr/bin/env bash
# Thirtieth H200 call: does the benchmark's client slow the server down? One process (bench_hybrid_split: no HTTP,
# no client) against servers whose client floats (--client-cpus all) or runs on the CPU the executor leaves
# (--client-cpus auto), alternating, with the workers' preemptions counted over each measured request.
# (--client-cpus existed only for this run: a pinned client was no faster, and the flag was removed after it.)
source scripts/gpu_prelude.sh
build
ceilings 30
step one-process; timeout 120 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs hybrid --json $OUT/split30.json 2>&1 | grep -vE "INFO|building" | tail -4
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits30.json --json $OUT/decode_run30.jsonl"
for i in 1 2 3; do
  step "round $i floating client"; timeout 75 $BENCH --backend hybrid --client-cpus all --log-dir runs/f_$i 2>&1 | row
  step "round $i pinned client"; timeout 75 $BENCH --backend hybrid --log-dir runs/p_$i 2>&1 | row
done
step auto; timeout 100 $BENCH --backend auto --log-dir runs/auto 2>&1 | row
fields "$OUT/decode_run30.jsonl" backend client_cpus decode_tok_s worker_preemptions engine_step_ms fetch_fraction

#!/usr/bin/env bash
# Twenty-second H200 call (run 20's machine): where a hybrid decode step's time goes. One process, the engine's
# runner and decode graphs: per layer the GPU side, the wait for the CPU, the serial part (CPU result in -> next
# job out) and the CPU's time per job, then the GPU kernels of 8 profiled steps per config.
source scripts/gpu_prelude.sh
build
step split; timeout 300 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs hybrid,cpu,offload,hybrid+w3 \
   --profile-steps 8 --json $OUT/split22.json > $OUT/split22.log 2>&1; echo "rc $?"
grep -v "it/s\]\|config/s\]\|s/config\]" $OUT/split22.log | grep -iE "error|Traceback|failed" | head -5
sed -n '/slots (/,$p' $OUT/split22.log

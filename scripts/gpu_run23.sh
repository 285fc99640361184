#!/usr/bin/env bash
# Twenty-third H200 call: decode attention split over key chunks (flash-decoding; run 22 found the one-program-
# per-head kernel at 68 us per layer, ~1.6 ms of every 24-layer step). GPU tests of the kernel, the models and the
# runner's graphs, ceilings, then one process (kernels and the serial part again) and end to end.
source scripts/gpu_prelude.sh
build
step gpu-tests; timeout 150 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/kernels/test_decode_attention.py \
   tests/engine/models tests/engine/runtime 2>&1 | tail -3
ceilings 23
step split; timeout 200 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs hybrid,hybrid+w3 \
   --profile-steps 8 --json $OUT/split23.json > $OUT/split23.log 2>&1; echo "rc $?"
sed -n '/slots (/,$p' $OUT/split23.log | head -40
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits23.json --json $OUT/decode_run23.jsonl"
step resident; timeout 60 $BENCH --backend resident --log-dir runs/d23r 2>&1 | grep -E "^ +resident"
step hybrid; timeout 200 $BENCH --backend hybrid --repeat 3 --log-dir runs/d23 2>&1 | grep -vE "server/s\]|s/server\]" | tail -8
grep -h "split settled" runs/d23/serve-*.log | cut -c1-200

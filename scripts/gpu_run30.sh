#!/usr/bin/env bash
# Thirtieth H200 call: does the benchmark's client slow the server down? One process (bench_hybrid_split: no HTTP,
# no client) against servers whose client floats (--client-cpus all) or runs on the CPU the executor leaves
# (--client-cpus auto), alternating, with the workers' preemptions counted over each measured request.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
row() { grep -E "^ +(resident|hybrid|offload|cpu|auto) "; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits30.txt 2>&1); grep -E "GBs" $OUT/physlimits30.txt | grep -E "h2d_gather_8|overlap|c_avx512_stream"
cp $OUT/physlimits.json $OUT/physlimits30.json
step one-process; timeout 120 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 --configs hybrid --json $OUT/split30.json 2>&1 | grep -vE "INFO|building" | tail -4
BENCH="python3 -m benchmarks.bench_decode_moe --model $M24 --cache-rate 0.33 --decode-tokens 128 --warmup-tokens 384
  --startup-timeout 100 --ceilings $OUT/physlimits30.json --json $OUT/decode_run30.jsonl"
for i in 1 2 3; do
  step "round $i floating client"; timeout 75 $BENCH --backend hybrid --client-cpus all --log-dir runs/f_$i 2>&1 | row
  step "round $i pinned client"; timeout 75 $BENCH --backend hybrid --log-dir runs/p_$i 2>&1 | row
done
step auto; timeout 100 $BENCH --backend auto --log-dir runs/auto 2>&1 | row
python3 - <<'PY'
import json, os
for line in open(os.environ["OUT"] + "/decode_run30.jsonl"):
    r = json.loads(line)
    print(r["backend"], r["client_cpus"], round(r.get("decode_tok_s", 0), 1), "preempted", r.get("worker_preemptions"),
          "step_ms", round(r.get("engine_step_ms", 0), 2), "f", r.get("fetch_fraction"))
PY

#!/usr/bin/env bash
# Ninth H200 call: ceilings; the 24-layer cut end to end (resident; cpu at a third cached; offload and hybrid
# at 20 % and 50 % cached: the sweep around run 8's third) and the full 48 layers with the VRAM capped at 24 GiB.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run9.jsonl"
show() { grep -v "server/s\]" | tail -6; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits9.txt 2>&1); grep -E "GBs" $OUT/physlimits9.txt | head -24
step decode24-resident-cpu; timeout 120 $BENCH --model "$M24" --backend resident,cpu --cache-rate 0.33 --decode-tokens 128 2>&1 | show
step decode48; timeout 190 $BENCH --model synthetic:qwen3-30b-a3b --backend offload,hybrid --gpu-memory-limit 24 --decode-tokens 64 2>&1 | show
step decode24-sweep; timeout 200 $BENCH --model "$M24" --backend hybrid,offload --cache-rate 0.5,0.2 --decode-tokens 128 2>&1 | show
tar czf $OUT/serve_logs9.tgz runs/bench_decode 2>/dev/null

#!/usr/bin/env bash
# Twelfth H200 call: hybrid starts the prefetch copy after the CPU's part (run 11 started it beside the CPU's
# work and gained nothing). The split bench picks the best --moe-prefetch for hybrid; then end to end
# through the OpenAI API with it (24-layer cut at a third cached, and the full 48 layers at 24 GiB).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
show() { grep -v "server/s\]" | tail -6; }
step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step gpu-tests; timeout 120 python3 -m pytest -q -x -m gpu -p no:cacheprovider tests/engine/moe/test_prefetch.py 2>&1 | tail -2
step split; timeout 240 python3 -m benchmarks.bench_hybrid_split --cache-rate 0.33 \
   --configs hybrid,hybrid+p1,hybrid+p2,hybrid+p3,offload,offload+p1 --json $OUT/split12.json > $OUT/split12.log 2>&1; echo "rc $?"
sed -n '/slots (/,$p' $OUT/split12.log
P=$(python3 -c "
import json; rows=[r for r in json.load(open('$OUT/split12.json'))['rows'] if r['config'].startswith('hybrid') and 'tok_s' in r]
best=max(rows, key=lambda r: r['tok_s'])['config']; print(best.split('+p')[1] if '+p' in best else 0)")
echo "best hybrid prefetch: $P"
step physlimits; (cd .tools && timeout 90 python3 physlimits.py > $OUT/physlimits12.txt 2>&1); grep -E "GBs" $OUT/physlimits12.txt | head -24
BENCH="python3 -m benchmarks.bench_decode_moe --warmup-tokens 384 --startup-timeout 100 --json $OUT/decode_run12.jsonl"
step decode24-prefetch-$P; timeout 170 $BENCH --model "$M24" --backend hybrid,offload,auto --cache-rate 0.33 --decode-tokens 128 \
   --server-arg=--moe-prefetch=$P 2>&1 | show
step decode24-hybrid-plain; timeout 70 $BENCH --model "$M24" --backend hybrid --cache-rate 0.33 --decode-tokens 128 --log-dir runs/bench_decode_plain 2>&1 | show
step decode48-prefetch-$P; timeout 150 $BENCH --model synthetic:qwen3-30b-a3b --backend hybrid,offload --gpu-memory-limit 24 \
   --decode-tokens 64 --server-arg=--moe-prefetch=$P 2>&1 | show
grep "auto verdict\|split settled" runs/bench_decode*/serve-*.log | cut -c1-400
tar czf $OUT/serve_logs12.tgz runs/bench_decode runs/bench_decode_plain 2>/dev/null

#!/usr/bin/env bash
# Sixth H200 call: the graph-mode hybrid handoff (now the default) on CUDA — its GPU tests, then offload,
# cpu and hybrid end to end on the 24-layer cut with a third of the experts cached, ceilings in the same run.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
step build; timeout 120 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1
step pinning; timeout 60 python3 -c "
import time, torch
from services.engine.moe.banks import enable_fast_pinning
print('fast pinning:', enable_fast_pinning())
t = time.perf_counter(); x = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True); dt = time.perf_counter() - t
print(f'pinned 4 GiB in {dt:.2f} s ({4 * 1.074 / dt:.1f} GB/s), is_pinned={x.is_pinned()}')
d = torch.empty_like(x, device='cuda'); torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(3): d.copy_(x, non_blocking=True)
torch.cuda.synchronize(); print(f'H2D from it: {3 * 4.295 / (time.perf_counter() - t):.1f} GB/s')
" 2>&1 | tail -3
step gpu-tests; timeout 200 python3 -m pytest -m gpu tests/engine/moe tests/kernels -q -p no:cacheprovider 2>&1 | tail -25 | tee $OUT/gpu_tests6.txt
step physlimits; (cd .tools && timeout 150 python3 physlimits.py > $OUT/physlimits6.txt 2>&1); grep -E "GBs" $OUT/physlimits6.txt | head -24
step decode24; timeout 260 python3 -m benchmarks.bench_decode_moe --model 'synthetic:qwen3-30b-a3b?layers=24' \
   --backend offload,hybrid,cpu --cache-rate 0.33 --decode-tokens 128 --startup-timeout 100 --json $OUT/decode24_run6.jsonl 2>&1 | tail -6
for b in offload hybrid cpu; do echo "--- $b"; sed 's/\r/\n/g' runs/bench_decode/serve-$b*.log | grep -v "building\|^ *$" | grep -i "loaded\|pinn\|graph\|split\|hybrid\|error\|Traceback\|warn" | head -12; done
tar czf $OUT/serve_logs6.tgz runs/bench_decode 2>/dev/null
python3 -c "
import json, sys
for line in open('$OUT/decode24_run6.jsonl'):
    r = json.loads(line); s = r.get('split') or {}
    print(r['backend'], r.get('ok'), 'tok/s', r.get('decode_tok_s'), 'miss', r.get('miss_rate'), 'fetch_share', r.get('fetch_share'),
          {k: s.get(k) for k in ('fetch_fraction', 'fetch_fraction_target', 'pcie_bytes_per_second', 'cpu_bytes_per_second', 'c_sync_seconds', 'misses_per_layer', 'graph_mode', 'steps')},
          r.get('error', '')[:300])
"

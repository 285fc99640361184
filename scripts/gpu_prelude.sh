# Sourced by scripts/gpu_run21.sh and later: what every H200 call starts with. The wheels the device lacks
# (.whl, carried) go to /tmp/site; profiles and the executor's build cache stay in /tmp.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1 TANDEM_PROFILES_DIR=/tmp/profiles XDG_CACHE_HOME=/tmp/xdg
step() { echo; echo "=== $* ($(date +%T))"; }
M24='synthetic:qwen3-30b-a3b?layers=24'
row() { grep -E "^ +(resident|hybrid|offload|cpu|auto) "; }
build() { step build; timeout 90 python3 -m services.engine.moe.cpu_executor --build 2>&1 | tail -1; }
# physlimits.py's ceilings into $OUT/physlimitsN.txt and .json (N = $1), the bandwidths the bounds use printed
ceilings() {
  step physlimits; (cd .tools && timeout 90 python3 physlimits.py > "$OUT/physlimits$1.txt" 2>&1)
  grep -E "GBs" "$OUT/physlimits$1.txt" | grep -E "h2d_gather_8|overlap|c_avx512_stream"
  cp "$OUT/physlimits.json" "$OUT/physlimits$1.json"
}
# the named fields of every row of a bench_decode_moe JSONL ($1), one row per line, floats to 2 decimals
fields() {
  python3 - "$@" <<'PY'
import json, sys
path, *keys = sys.argv[1:]
for line in open(path):
    r = json.loads(line)
    print(" ".join(f"{k}={round(r[k], 2) if isinstance(r.get(k), float) else r.get(k)}" for k in keys))
PY
}

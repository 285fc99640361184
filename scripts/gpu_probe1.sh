#!/usr/bin/env bash
# First H200 call: ceilings, GPU tests of the model path, resident decode speed.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
lscpu | grep -E "Model name|^CPU\(s\)|Thread|Flags" | cut -c1-300
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"
(cd .tools && timeout 240 python3 physlimits.py) 2>&1 | tee $OUT/physlimits.txt
timeout 200 python3 -m pytest -m gpu tests/engine/models tests/kernels/test_moe_gemv.py -q -p no:cacheprovider -x 2>&1 | tail -30 | tee $OUT/gpu_tests.txt
timeout 240 python3 -m benchmarks.bench_resident_decode --tokens 64 --json $OUT/resident_decode.json 2>&1 | tail -30 | tee $OUT/resident.txt

#!/usr/bin/env bash
# Install the torch pyproject.toml pins into a venv, before the project itself (`make setup`).
#
#   scripts/install-torch.sh PYTHON [pip flags...]
#
# PyPI's torch is a CUDA build (~2.7 GB with its nvidia-* wheels); a laptop needs PyTorch's CPU build.
# So: a torch wheel pip already has without an index (installed, or in a find-links folder / wheelhouse
# of its configuration) is used first; otherwise torch comes from TORCH_INDEX, PyTorch's CPU index by
# default. TORCH_INDEX=https://pypi.org/simple (or .../whl/cu128) installs a CUDA build; TORCH_INDEX=""
# leaves the choice to pip's own configuration. torch's dependencies come with the project afterwards.
set -euo pipefail
cd "$(dirname "$0")/.."
py=$1
shift
index=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
pin=$(grep -o '"torch==[^"]*"' pyproject.toml | tr -d '"')
[ -n "$pin" ] || { echo "install-torch: no torch==VERSION pin in pyproject.toml" >&2; exit 1; }

if "$py" -m pip install -q --no-index --no-deps "$@" "$pin" >/dev/null 2>&1; then
    echo "torch: $pin from a wheel already on this machine"
elif [ -n "$index" ]; then
    echo "torch: $pin from $index"
    "$py" -m pip install -q --no-deps --index-url "$index" "$@" "$pin"
else
    echo "torch: $pin left to pip's configured index (TORCH_INDEX is empty)"
fi

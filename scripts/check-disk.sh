#!/usr/bin/env bash
# Before the first install: the .venv takes ~2.3 GiB (torch, triton, transformers) and pip unpacks its
# wheels under TMPDIR first. A full disk fails pip half-way with "[Errno 28] No space left on device";
# this names the problem, and where, before anything is written.
set -euo pipefail
need_gib=${TANDEM_SETUP_NEED_GIB:-4}
for dir in "$PWD" "${TMPDIR:-/tmp}"; do
    free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
    if [ "$free_kib" -lt $((need_gib * 1024 * 1024)) ]; then
        echo "setup: $dir has $((free_kib / 1024)) MiB free; installing the .venv needs ~${need_gib} GiB" \
             "(set TANDEM_SETUP_NEED_GIB to override)" >&2
        exit 1
    fi
done

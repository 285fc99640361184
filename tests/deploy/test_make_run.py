"""`make run`'s default shows the point of Tandem: the demo on the hybrid path with a small expert cache
(misses split between fetch and CPU, so the dashboard's expert panels have data), ARGS still winning."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def make_run_command(*extra: str) -> str:
    out = subprocess.run(["make", "-n", "run", *extra], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return next(line for line in out.stdout.splitlines() if "tandem stack" in line)


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_make_run_defaults_to_hybrid_with_a_small_cache():
    line = make_run_command()
    assert "--model ${TANDEM_MODEL:-demo}" in line
    assert "--moe-backend hybrid --moe-cache-rate 0.25" in line
    # user flags come after the defaults: the engine's parser keeps the last value
    assert make_run_command("ARGS=--moe-backend offload").endswith("--moe-backend offload")

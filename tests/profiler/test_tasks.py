"""run_cli, the body of both tasks, in-process: progress parsing, the result line, and the time limit
that kills a hung benchmark (the worker-level tests are in test_worker.py)."""

from __future__ import annotations

import os

import pytest

from services.profiler.tasks import BenchFailed, run_cli

FAST = ["--model", "tiny", "--seconds", "0.05", "--buffer-mib", "4", "--cpu-kernel", "torch"]


def test_progress_and_result_are_parsed(tmp_path):
    updates: list[dict] = []
    out = run_cli(["bench", "bw"], [*FAST, "--profiles-dir", str(tmp_path)], limit_s=120, on_progress=updates.append)
    assert out["result"]["profile_path"].startswith(str(tmp_path))
    assert len(updates) >= 3 and updates[-1]["stage"] == "done"
    assert out["command"].startswith("tandem bench bw")


def test_hung_benchmark_is_killed_at_the_limit(tmp_path):
    with pytest.raises(BenchFailed, match="killed after 3 s"):
        run_cli(["bench", "bw"], ["--model", "tiny", "--seconds", "60", "--buffer-mib", "4",
                                  "--profiles-dir", str(tmp_path)], limit_s=3, output_dirs=(tmp_path,))
    assert not tmp_path.exists() or os.listdir(tmp_path) == []  # no partial profile

"""run_cli, the body of both tasks, in-process: progress parsing, the result line, and the time limit
that kills a hung benchmark (the worker-level tests are in test_worker.py)."""

from __future__ import annotations

import os

import pytest

from services.profiler.tasks import BenchFailed, run_cli

FAST = ["--model", "tiny", "--seconds", "0.05", "--buffer-mib", "4", "--cpu-kernel", "torch"]


class RecordingTask:
    """Stands in for the bound Celery task: only update_state is used (to report PROGRESS)."""

    def __init__(self):
        self.updates: list[tuple[str, dict]] = []

    def update_state(self, state: str, meta: dict) -> None:
        self.updates.append((state, meta))


def test_progress_and_result_are_parsed(tmp_path):
    task = RecordingTask()
    out = run_cli(task, ["bench", "bw"], [*FAST, "--profiles-dir", str(tmp_path)], limit_s=120)
    assert out["result"]["profile_path"].startswith(str(tmp_path))
    assert [s for s, _ in task.updates] == ["PROGRESS"] * len(task.updates) and len(task.updates) >= 3
    assert task.updates[-1][1]["stage"] == "done"
    assert out["command"].startswith("tandem bench bw")


def test_hung_benchmark_is_killed_at_the_limit(tmp_path):
    task = RecordingTask()
    with pytest.raises(BenchFailed, match="killed after 3 s"):
        run_cli(task, ["bench", "bw"], ["--model", "tiny", "--seconds", "60", "--buffer-mib", "4",
                                        "--profiles-dir", str(tmp_path)], limit_s=3)
    assert not tmp_path.exists() or os.listdir(tmp_path) == []  # no partial profile

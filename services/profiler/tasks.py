"""Thin Celery tasks: run the same CLI code as `tandem bench bw|load` in a subprocess.

Why a subprocess: a benchmark can crash (CUDA error, OOM kill, a segfault in an extension); the
worker process must survive it and report FAILURE. Progress comes from the ``@@PROGRESS@@`` JSON
lines the CLI prints with ``--progress-lines`` (task state PROGRESS, meta = the line); the result
from its ``@@RESULT@@`` line. The profile itself is written by the subprocess atomically, so a job
that fails leaves the previous profile (or none), never a partial one.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time

from celery.exceptions import SoftTimeLimitExceeded

from services.common.logging import get_logger
from services.profiler.app import app
from services.profiler.bench_bw import PROGRESS_TAG, RESULT_TAG

log = get_logger("profiler.tasks")

BW_LIMIT_S = 1800  # bench bw: a few minutes on a GPU host; the hard limit only guards a hang
LOAD_LIMIT_S = 3600  # bench load: reads a whole checkpoint three times, cold
STDERR_TAIL = 30  # lines of the subprocess's stderr kept for the failure message


class BenchFailed(RuntimeError):
    """The benchmark subprocess failed; the message carries its exit status and stderr tail."""


def _check_argv(argv) -> list[str]:
    if argv is None:
        return []
    if not isinstance(argv, (list, tuple)) or not all(isinstance(a, str) for a in argv):
        raise BenchFailed(f"task argument must be a list of CLI flags (strings), got {argv!r}")
    return list(argv)


def run_cli(task, words: list[str], argv: list[str], limit_s: float) -> dict:
    """Run ``python -m services.cli WORDS... ARGV... --progress-lines``; report progress on ``task``;
    return {"command", "result" (the RESULT line), "output" (stdout tail)} or raise BenchFailed."""
    cmd = [sys.executable, "-m", "services.cli", *words, *argv, "--progress-lines"]
    log.info("running %s", " ".join(cmd[2:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1)
    err_tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL)
    err_thread = threading.Thread(target=lambda: err_tail.extend(proc.stderr), daemon=True)
    err_thread.start()
    killer = threading.Timer(limit_s, proc.kill)  # our own limit: works in any pool (solo too)
    killer.start()
    out_tail: collections.deque[str] = collections.deque(maxlen=60)
    result = None
    t0 = time.monotonic()
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(PROGRESS_TAG):
                meta = json.loads(line[len(PROGRESS_TAG):])
                task.update_state(state="PROGRESS", meta=meta)
            elif line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
            else:
                out_tail.append(line)
        rc = proc.wait()
    except SoftTimeLimitExceeded:
        proc.kill()
        proc.wait()
        raise BenchFailed(f"`tandem {' '.join(words)}` exceeded the task's soft time limit; killed")
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        err_thread.join(timeout=5)
    command = "tandem " + " ".join(words + argv)
    if rc != 0 or result is None:
        why = f"killed after {limit_s:.0f} s" if time.monotonic() - t0 >= limit_s else f"exited {rc}"
        tail = "".join(err_tail).strip() or "\n".join(out_tail).strip() or "(no output)"
        raise BenchFailed(f"`{command}` {why}: {tail[-4000:]}")
    return {"command": command, "result": result, "output": "\n".join(out_tail)}


@app.task(name="tandem.bench_bw", bind=True, soft_time_limit=BW_LIMIT_S, time_limit=BW_LIMIT_S + 60)
def bench_bw(self, argv: list[str] | None = None) -> dict:
    """`tandem bench bw ARGV`: the result has profile_path, gpu_uuid and a summary of the bandwidths."""
    out = run_cli(self, ["bench", "bw"], _check_argv(argv), BW_LIMIT_S)
    return {**out["result"], "command": out["command"], "output": out["output"]}


@app.task(name="tandem.bench_load", bind=True, soft_time_limit=LOAD_LIMIT_S, time_limit=LOAD_LIMIT_S + 60)
def bench_load(self, argv: list[str] | None = None) -> dict:
    """`tandem bench load ARGV`: the result has one row per mode (load_s, bytes, checksum, status)."""
    out = run_cli(self, ["bench", "load"], _check_argv(argv), LOAD_LIMIT_S)
    return {**out["result"], "command": out["command"], "output": out["output"]}

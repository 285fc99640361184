"""Thin Celery tasks: run the same CLI code as `tandem bench bw|load` in a subprocess.

A job is a typed request (services/common/jobs.py): the task validates it again (the queue is an
input too) and builds the command line itself, with every output inside the worker's profiles dir.

Why a subprocess: a benchmark can crash (CUDA error, OOM kill, a segfault in an extension); the
worker process must survive it and report FAILURE. Progress comes from the ``@@PROGRESS@@`` JSON
lines the CLI prints with ``--progress-lines`` (written to the job record, best effort: a Redis
outage loses progress lines, never the benchmark); the result from its ``@@RESULT@@`` line. The
profile itself is written by the subprocess atomically, so a job that fails leaves the previous
profile (or none), never a partial one; a subprocess killed mid-write leaves no temp file either.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from celery.exceptions import Ignore, SoftTimeLimitExceeded
from celery.states import READY_STATES
from pydantic import TypeAdapter, ValidationError

from services.common.jobs import (ALL_GPUS, HEARTBEAT_S, MAX_ATTEMPTS, BenchBwRequest, BenchLoadRequest, JobRequest,
                                  JobStore)
from services.common.logging import get_logger
from services.common.settings import env
from services.profiler.app import BW_LIMIT_S, LOAD_LIMIT_S, app, report_profiles
from services.profiler.bench_bw import PROGRESS_TAG, RESULT_TAG
from services.profiler.metrics import nvml_gpu_uuids
from services.profiler.recovery import WorkerLost

log = get_logger("profiler.tasks")

STDERR_TAIL = 30  # lines of the subprocess's stderr kept for the failure message
_REQUEST = TypeAdapter(JobRequest)


class BenchFailed(RuntimeError):
    """The benchmark subprocess failed; the message carries its exit status and stderr tail."""


def run_cli(words: list[str], argv: list[str], limit_s: float, on_progress: Callable[[dict], None] | None = None,
            output_dirs: tuple[Path, ...] = ()) -> dict:
    """Run ``python -m services.cli WORDS... ARGV... --progress-lines``; pass each progress line to
    ``on_progress``; return {"command", "result" (the RESULT line), "output" (stdout tail)} or raise
    BenchFailed. A subprocess killed here (time limit) may have been writing: the temp files it
    left in ``output_dirs`` since it started are removed."""
    cmd = [sys.executable, "-m", "services.cli", *words, *argv, "--progress-lines"]
    log.info("running %s", " ".join(cmd[2:]))
    t0_wall = time.time()
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
                if on_progress is not None:
                    on_progress(json.loads(line[len(PROGRESS_TAG):]))
            elif line.startswith(RESULT_TAG):
                result = json.loads(line[len(RESULT_TAG):])
            else:
                out_tail.append(line)
        rc = proc.wait()
    except SoftTimeLimitExceeded:
        raise BenchFailed(f"`tandem {' '.join(words)}` exceeded the task's soft time limit; killed")
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.returncode < 0:  # killed by a signal: it may have died inside an atomic write
            _remove_temp_files(output_dirs, since=t0_wall)
        err_thread.join(timeout=5)
    command = "tandem " + " ".join(words + argv)
    if rc != 0 or result is None:
        why = f"killed after {limit_s:.0f} s" if time.monotonic() - t0 >= limit_s else f"exited {rc}"
        tail = "".join(err_tail).strip() or "\n".join(out_tail).strip() or "(no output)"
        raise BenchFailed(f"`{command}` {why}: {tail[-4000:]}")
    return {"command": command, "result": result, "output": "\n".join(out_tail)}


def _remove_temp_files(dirs: tuple[Path, ...], since: float) -> None:
    """Delete the ``.tmp-*`` files of services/common/atomic_file.py made in ``dirs`` at or after ``since``."""
    for d in dirs:
        for path in d.glob(".tmp-*") if d.is_dir() else ():
            try:
                if path.stat().st_mtime >= since - 1:
                    path.unlink()
                    log.info("removed %s, left by the killed benchmark", path)
            except FileNotFoundError:
                pass


class Job:
    """One delivery of a job on this worker: its record, its progress, its end (see app.py on delivery)."""

    def __init__(self, task, kind: str, args: tuple, request) -> None:
        self.id, self.worker = task.request.id, task.request.hostname
        if args:
            raise BenchFailed("raw CLI flags are not accepted (they could write files anywhere); send a typed "
                              "request: services/common/jobs.py, docs/operating.md")
        try:
            self.request = _REQUEST.validate_python({"kind": kind, **(request or {})})
        except (ValidationError, TypeError) as exc:
            raise BenchFailed(f"invalid {kind} job request: {exc}") from None
        self.store = JobStore(env("TANDEM_REDIS_URL"))
        self.profiles_dir = Path(env("TANDEM_PROFILES_DIR"))
        self._progress_failed = False

    def __enter__(self) -> "Job":
        if app.backend.get_state(self.id) in READY_STATES:  # a duplicate delivery of a job that ended
            log.warning("job %s already ended; this delivery is dropped", self.id)
            raise Ignore()
        attempt = self.store.started(self.id, self.worker)
        if attempt > MAX_ATTEMPTS:
            raise WorkerLost(f"the worker died {attempt - 1} times while running this job (killed, out of "
                             f"memory?); not running it again")
        if attempt > 1:
            log.warning("job %s: attempt %d (the previous one's worker died)", self.id, attempt)
        self._beating = threading.Event()
        threading.Thread(target=self._heartbeat, name=f"heartbeat-{self.id}", daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        """While the job runs: tell the record this worker is alive (the job view flags a silent one)."""
        while not self._beating.wait(HEARTBEAT_S):
            try:
                self.store.heartbeat(self.id)
            except Exception:  # noqa: BLE001 — Redis away: the next beat tries again
                pass

    def __exit__(self, *exc) -> None:
        self._beating.set()
        try:
            self.store.ended(self.id, self.worker)
        except Exception as e:  # noqa: BLE001 — Redis down: the record only misses its end
            log.warning("job %s: could not record its end: %s", self.id, e)
        report_profiles()  # a new profile (or a failed job's unchanged dir): GET /admin/profiles sees it now

    def progress(self, meta: dict) -> None:
        """Best effort: Redis being away must not stop (or kill) the benchmark."""
        try:
            self.store.progress(self.id, meta)
        except Exception as exc:  # noqa: BLE001
            if not self._progress_failed:
                log.warning("job %s: progress not recorded (%s); the benchmark goes on", self.id, exc)
            self._progress_failed = True


def gpus_to_profile(selector: str | None, list_gpus: Callable[[], list[str]] = nvml_gpu_uuids) -> list[str | None]:
    """The ``--gpu`` of each `tandem bench bw` a job runs: ``"all"`` -> every GPU NVML lists (this worker's
    GPUs: one per engine on a host running an engine per GPU), or [None] (the CPU-only profile) when it
    lists none; anything else -> just that selector (None: the first visible GPU)."""
    if selector != ALL_GPUS:
        return [selector]
    return list(list_gpus()) or [None]


@app.task(name="tandem.bench_bw", bind=True, soft_time_limit=BW_LIMIT_S, time_limit=BW_LIMIT_S + 60)
def bench_bw(self, *args, request: dict | None = None) -> dict:
    """`tandem bench bw` for a ``BenchBwRequest``: the result has profile_path, gpu_uuid and a summary.
    With ``gpu: "all"`` one benchmark per GPU, one after the other (two at once would share the host's
    DRAM bandwidth and both measure less): {"profiles": [one such result per GPU], "gpu_uuids": [...]}.
    A GPU that fails fails the job; the profiles of the GPUs measured before it are kept."""
    with Job(self, "bw", args, request) as job:
        req: BenchBwRequest = job.request
        targets = gpus_to_profile(req.gpu)
        results = []
        for n, gpu in enumerate(targets, 1):
            argv = [*req.model_copy(update={"gpu": gpu}).cli_args(), f"--profiles-dir={job.profiles_dir}"]
            progress = job.progress if len(targets) == 1 else (
                lambda meta, gpu=gpu, n=n: job.progress({**meta, "gpu": gpu, "gpu_number": n, "gpus": len(targets)}))
            out = run_cli(["bench", "bw"], argv, BW_LIMIT_S, progress, (job.profiles_dir,))
            results.append({**out["result"], "command": out["command"], "output": out["output"]})
    if req.gpu != ALL_GPUS:
        return results[0]
    return {"profiles": results, "gpu_uuids": [r["gpu_uuid"] for r in results]}


@app.task(name="tandem.bench_load", bind=True, soft_time_limit=LOAD_LIMIT_S, time_limit=LOAD_LIMIT_S + 60)
def bench_load(self, *args, request: dict | None = None) -> dict:
    """`tandem bench load` for a ``BenchLoadRequest``: one result row per mode (load_s, bytes, checksum,
    status); the bank file lives in <profiles dir>/banks/<checkpoint name>."""
    with Job(self, "load", args, request) as job:
        req: BenchLoadRequest = job.request
        bank_dir = job.profiles_dir / "banks" / req.bank_name()
        out = run_cli(["bench", "load"], req.cli_args(str(bank_dir)), LOAD_LIMIT_S, job.progress,
                      (job.profiles_dir, bank_dir))
    return {**out["result"], "command": out["command"], "output": out["output"]}

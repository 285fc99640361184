"""Every Prometheus metric the profiling worker exports, declared once (vLLM ``v1/metrics/loggers.py`` style).

Torch-free. The Celery app calls one function from its ``worker_init`` signal:

    start_worker_metrics_server()   # HTTP on TANDEM_WORKER_METRICS_PORT (9101), task signals connected

Job metrics come from Celery's task signals, which fire in the process that runs the task: run the
worker with ``--pool solo`` (one GPU benchmark at a time is what we want anyway: two at once would
disturb each other's bandwidth numbers), so the counters live in the process that serves /metrics.
Profile freshness is read from the profiles directory at each scrape (``ProfileCollector``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import datetime, timezone
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram, REGISTRY, disable_created_metrics, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.common.logging import get_logger
from services.common.profiles import list_profiles, normalize_uuid
from services.common.settings import env

# No *_created series: they double the exposition and no panel or rule reads them.
disable_created_metrics()

log = get_logger("profiler.metrics")

JOB_STATES = ("started", "succeeded", "failed")
JOBS = Counter("tandem_profiler_jobs_total",
               "Profiler jobs by task name and state (started, succeeded, failed).", ["task", "state"])
JOB_DURATION = Histogram("tandem_profiler_job_duration_seconds",
                         "Wall time of one profiler job, start to end (bandwidth sweeps take minutes).", ["task"],
                         buckets=[0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0])
JOBS_RUNNING = Gauge("tandem_profiler_jobs_running", "Profiler jobs running now.", ["task"])
JOB_FAILURES = Counter("tandem_profiler_job_failures_total",
                       "Failed profiler jobs by exception type.", ["task", "exception"])


class WorkerMetrics:
    """One-line job hooks (the Celery signal handlers call these; tests may too)."""

    _started: dict[str, float] = {}  # task id -> perf_counter at start
    _lock = threading.Lock()

    @staticmethod
    def declare_tasks(names: Iterable[str]) -> None:
        """Create each task's series at 0 so the first job shows in increase()/rate() (a series
        first scraped at 1 has no increase)."""
        for name in names:
            task = _task_name(name)
            for state in JOB_STATES:
                JOBS.labels(task, state)
            JOB_DURATION.labels(task)
            JOBS_RUNNING.labels(task)

    @classmethod
    def job_started(cls, task: str, job_id: str) -> None:
        with cls._lock:
            cls._started[job_id] = time.perf_counter()
        JOBS.labels(task, "started").inc()
        JOBS_RUNNING.labels(task).inc()

    @classmethod
    def job_finished(cls, task: str, job_id: str, ok: bool, exception: str = "") -> None:
        """A job ended; ``exception`` is the exception class name when ``ok`` is false."""
        with cls._lock:
            start = cls._started.pop(job_id, None)
        if start is not None:
            JOB_DURATION.labels(task).observe(time.perf_counter() - start)
            JOBS_RUNNING.labels(task).dec()
        JOBS.labels(task, "succeeded" if ok else "failed").inc()
        if not ok:
            JOB_FAILURES.labels(task, exception or "unknown").inc()


class ProfileCollector(Collector):
    """At each scrape: ``tandem_profile_present{gpu}`` and ``tandem_profile_age_seconds{gpu}``.

    GPUs come from ``list_gpus()`` (NVML on the GPU host) plus every profile file found, so a GPU
    without a profile shows ``present 0`` and a profile of a GPU no longer installed still shows its age.
    """

    def __init__(self, profiles_dir: Callable[[], Path], list_gpus: Callable[[], list[str]]) -> None:
        self._profiles_dir = profiles_dir
        self._list_gpus = list_gpus

    def collect(self) -> Iterable[GaugeMetricFamily]:
        present = GaugeMetricFamily("tandem_profile_present",
                                    "1 when a bandwidth profile exists for the GPU, 0 when it has none.",
                                    labels=["gpu"])
        age = GaugeMetricFamily("tandem_profile_age_seconds",
                                "Seconds since the GPU's bandwidth profile was measured.", labels=["gpu"])
        now = time.time()
        measured = read_profile_times(self._profiles_dir())
        for gpu in sorted({normalize_uuid(g) for g in self._safe_gpus()} | set(measured)):
            present.add_metric([gpu], 1.0 if gpu in measured else 0.0)
            if gpu in measured:
                age.add_metric([gpu], max(0.0, now - measured[gpu]))
        yield present
        yield age

    def _safe_gpus(self) -> list[str]:
        try:
            return list(self._list_gpus())
        except Exception as exc:  # a scrape must not fail because NVML hiccupped
            log.warning("listing GPUs for tandem_profile_present failed: %s", exc)
            return []


def read_profile_times(profiles_dir: Path) -> dict[str, float]:
    """GPU uuid -> unix time its profile was measured, for each usable profile in ``profiles_dir``.

    Uses the profile store's reader (``services.common.profiles``): a corrupt, foreign or old-schema
    file counts as no profile, exactly as the engine would treat it; it is logged, never raised, so a
    bad file cannot break the scrape.
    """
    out: dict[str, float] = {}
    for entry in list_profiles(profiles_dir):
        if entry.profile is None:
            log.warning("profile %s unusable (%s); counted as missing", entry.path, entry.error)
            continue
        out[normalize_uuid(entry.profile.gpu.uuid)] = _measured_time(entry.profile.created_at, entry.path)
    return out


def _measured_time(created_at: str, path: Path) -> float:
    """Unix seconds of an ISO 8601 ``created_at`` ("...Z" accepted); the file's mtime if unparsable."""
    try:
        stamp = datetime.fromisoformat(created_at.replace("Z", "+00:00"))
    except ValueError:
        return path.stat().st_mtime
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=timezone.utc)  # the store writes UTC
    return stamp.timestamp()


def nvml_gpu_uuids() -> list[str]:
    """UUIDs of the GPUs NVML sees; [] where there is no NVIDIA driver (CI, laptops)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # no driver / no GPU: nothing to profile, nothing to alert on
        return []
    try:
        uuids = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return uuids
    finally:
        pynvml.nvmlShutdown()


# Process state: the worker calls start_worker_metrics_server once, from its worker_init signal.
_server_started = False
_server_pid: int | None = None  # the process serving /metrics
_signals_connected = False
_warned_child = False


def start_worker_metrics_server(port: int | None = None, addr: str = "0.0.0.0",
                                list_gpus: Callable[[], list[str]] = nvml_gpu_uuids) -> int:
    """Serve the worker's metrics on ``port`` (default TANDEM_WORKER_METRICS_PORT) and connect the Celery
    task signals. Idempotent (a second call is a no-op). Returns the port; 0 when disabled (port 0)."""
    global _server_started, _server_pid
    port = int(env("TANDEM_WORKER_METRICS_PORT")) if port is None else port
    if _server_started or port == 0:
        return port
    try:
        start_http_server(port, addr=addr)
    except OSError as exc:
        raise OSError(f"worker metrics: port {port} is taken ({exc}); set TANDEM_WORKER_METRICS_PORT "
                      "to a free port, or 0 to disable") from exc
    REGISTRY.register(ProfileCollector(lambda: Path(env("TANDEM_PROFILES_DIR")), list_gpus))
    connect_celery_signals()
    _server_started = True
    _server_pid = os.getpid()
    log.info("worker metrics on http://%s:%d/metrics", addr, port)
    return port


def connect_celery_signals() -> None:
    """Count every task run by this worker process (prerun -> started, postrun -> succeeded/failed).
    Idempotent: connecting twice would count every job twice."""
    global _signals_connected
    if _signals_connected:
        return
    _signals_connected = True
    from celery import signals

    def prerun(sender=None, task_id=None, task=None, **_):
        _warn_if_pool_child()
        WorkerMetrics.job_started(_task_name(task or sender), task_id or "")

    def postrun(sender=None, task_id=None, task=None, state=None, retval=None, **_):
        ok = state == "SUCCESS"
        exc = type(retval).__name__ if isinstance(retval, BaseException) else str(state or "")
        WorkerMetrics.job_finished(_task_name(task or sender), task_id or "", ok, "" if ok else exc)

    def ready(sender=None, **_):
        app = getattr(sender, "app", None)
        WorkerMetrics.declare_tasks(name for name in (app.tasks if app is not None else ())
                                    if not name.startswith("celery."))

    # weak=False: the handlers are closures that would otherwise be garbage-collected at once.
    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)
    signals.worker_ready.connect(ready, weak=False)


def _warn_if_pool_child() -> None:
    """Counters bumped in a prefork pool child never reach the parent's /metrics: say so once."""
    global _warned_child
    if _server_pid is not None and os.getpid() != _server_pid and not _warned_child:
        _warned_child = True
        log.warning("profiler job metrics are counted in pool process %d, not in the process serving "
                    "/metrics (%d): run the worker with --pool solo (or set worker_pool='solo')",
                    os.getpid(), _server_pid)


def _task_name(task) -> str:
    # Short name ("bench_bw" for "tandem.bench_bw"): the dashboards group by it.
    name = getattr(task, "name", None) or str(task)
    return name.rsplit(".", 1)[-1]

"""The profiler worker's Celery app (torch-free to import): `celery -A services.profiler.app worker`.

Broker and result backend: env TANDEM_REDIS_URL. One benchmark at a time per GPU host (two at once
would disturb each other's bandwidth numbers): concurrency 1, prefetch 1, acks late (a job is
acknowledged when it ends, so a worker that dies mid-job does not silently lose it).

Queues: each worker consumes its host's queue (env TANDEM_PROFILER_QUEUE, default
``tandem.profiler.<hostname>``) and the shared ``tandem.profiler`` queue. Send to a host queue to
profile that host's GPU; the shared queue is for single-host setups ("any GPU host").
"""

from __future__ import annotations

import socket

from celery import Celery, signals
from kombu import Queue

from services.common.settings import env

SHARED_QUEUE = "tandem.profiler"


def host_queue() -> str:
    """This host's queue name."""
    return env("TANDEM_PROFILER_QUEUE") or f"{SHARED_QUEUE}.{socket.gethostname()}"


app = Celery("tandem.profiler", broker=env("TANDEM_REDIS_URL"), backend=env("TANDEM_REDIS_URL"),
             include=["services.profiler.tasks"])
app.conf.update(
    task_serializer="json", result_serializer="json", accept_content=["json"],
    task_queues=[Queue(host_queue()), Queue(SHARED_QUEUE)],
    task_default_queue=SHARED_QUEUE,
    worker_concurrency=1,
    # solo pool: tasks run in the worker process itself, so the job metrics they record reach the
    # worker's /metrics (a prefork child's counters would be lost). The benchmark itself already runs
    # in a subprocess, so a crash still cannot take the worker down.
    worker_pool="solo",
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_track_started=True,  # STARTED between PENDING and PROGRESS: the admin API shows "running"
    result_extended=True,  # keep task name and args with the result (the admin API lists jobs)
    result_expires=7 * 24 * 3600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@signals.worker_init.connect
def _start_metrics(**_) -> None:
    from services.common.logging import setup_logging
    from services.profiler.metrics import start_worker_metrics_server

    setup_logging()
    start_worker_metrics_server()


def submit(task: str, argv: list[str], queue: str | None = None):
    """Send ``tandem.bench_bw`` / ``tandem.bench_load`` with CLI flags ``argv`` to ``queue`` (default:
    the shared queue). Returns the AsyncResult. For clients (gateway admin API, tests)."""
    return app.send_task(task, args=[list(argv)], queue=queue or SHARED_QUEUE)

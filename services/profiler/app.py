"""The profiler worker's Celery app (torch-free to import): `celery -A services.profiler.app worker`.

Broker and result backend: env TANDEM_REDIS_URL. One benchmark at a time per GPU host (two at once
would disturb each other's bandwidth numbers): concurrency 1, prefetch 1.

Delivery (docs/operating.md): a job's message is acknowledged when the job ends (acks late), so a
worker that dies mid-job does not lose it. When that worker starts again it puts the jobs it was
running back at the head of their queue (``recovery.requeue_interrupted``); a job whose worker died
``MAX_ATTEMPTS`` times fails instead of running again; a job no worker comes back for is redelivered
by kombu after the visibility timeout (longer than any job may run, so a running job is never sent twice).

Queues: each worker consumes its node's queue ``tandem.profiler.<node>`` (env TANDEM_NODE_NAME, on
Kubernetes the pod's ``spec.nodeName`` through the downward API; default the hostname), the queue
named by TANDEM_PROFILER_QUEUE when set, and the shared ``tandem.profiler`` queue. Send to a node's
queue (``{"node": ...}`` on POST /admin/profiles) to profile that node's GPUs; the shared queue is for
single-host setups ("any GPU host"). The worker reports its profiles to Redis under its node's name at
start and after each job (services/common/node_profiles.py), so the gateway lists every node's.
"""

from __future__ import annotations

import socket

from celery import Celery, signals
from kombu import Queue

from services.common.jobs import JOB_TTL_S, SHARED_QUEUE, JobStore, check_node, node_queue, send_job
from services.common.settings import env

BW_LIMIT_S = 1800  # bench bw: a few minutes on a GPU host; the hard limit only guards a hang
LOAD_LIMIT_S = 3600  # bench load: reads a whole checkpoint three times, cold
# Longer than any job may run (its hard limit + 60 s): kombu redelivers an unacknowledged message
# only after this, so a job still running is never handed to a second worker.
VISIBILITY_TIMEOUT_S = LOAD_LIMIT_S + 600


def node_name() -> str:
    """The node this worker measures: TANDEM_NODE_NAME (Kubernetes: the pod's node), else the hostname."""
    return env("TANDEM_NODE_NAME") or socket.gethostname()


def host_queue() -> str:
    """This host's queue name: TANDEM_PROFILER_QUEUE, else its node's queue."""
    return env("TANDEM_PROFILER_QUEUE") or node_queue(node_name())


def worker_queues() -> list[str]:
    """Every queue this worker consumes: its node's, the one TANDEM_PROFILER_QUEUE names, the shared one."""
    return list(dict.fromkeys([node_queue(node_name()), host_queue(), SHARED_QUEUE]))


app = Celery("tandem.profiler", broker=env("TANDEM_REDIS_URL"), backend=env("TANDEM_REDIS_URL"),
             include=["services.profiler.tasks"])
app.conf.update(
    task_serializer="json", result_serializer="json", accept_content=["json"],
    task_queues=[Queue(name) for name in worker_queues()],
    task_default_queue=SHARED_QUEUE,
    worker_concurrency=1,
    # solo pool: tasks run in the worker process itself, so the job metrics they record reach the
    # worker's /metrics (a prefork child's counters would be lost). The benchmark itself already runs
    # in a subprocess, so a crash still cannot take the worker down.
    worker_pool="solo",
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    task_reject_on_worker_lost=True,  # prefork: a killed child's job goes back to the queue, not FAILURE
    broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
    # Running / progress live in the job record (services/common/jobs.py); Celery's result holds the
    # end state only, so a redelivered duplicate of a finished job can see that and do nothing.
    task_track_started=False,
    result_extended=True,  # keep task name and args with the result
    result_expires=JOB_TTL_S,
    # A finished benchmark's result is stored even across a short Redis outage (~5 min of retries).
    result_backend_always_retry=True,
    result_backend_max_retries=30,
    # Losing the broker must not kill a running benchmark: it finishes and its result is stored when
    # Redis is back.
    worker_cancel_long_running_tasks_on_connection_loss=False,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)


@signals.worker_init.connect
def _start_metrics(**_) -> None:
    from services.common.logging import setup_logging
    from services.profiler.metrics import start_worker_metrics_server

    setup_logging()
    start_worker_metrics_server()


@signals.worker_ready.connect
def _requeue_interrupted(sender, **_) -> None:
    from services.profiler.recovery import requeue_interrupted

    requeue_interrupted(app, sender.hostname)
    report_profiles()


def report_profiles() -> None:
    """Tell Redis what this node's profiles directory holds (best effort: Redis away, the next job's
    report catches up)."""
    from services.common.logging import get_logger
    from services.common.node_profiles import report

    try:
        count = report(JobStore(env("TANDEM_REDIS_URL")).redis, node_name(), env("TANDEM_PROFILES_DIR"))
        get_logger("profiler").info("node %s: %d profile(s) reported", node_name(), count)
    except Exception as exc:  # noqa: BLE001
        get_logger("profiler").warning("node %s: profiles not reported: %s", node_name(), exc)


def submit(request, queue: str | None = None, node: str | None = None) -> str:
    """Record and send a job (a ``services.common.jobs`` request) to ``node``'s queue, or ``queue``
    (default: the shared queue); returns the job id. For clients without the gateway (scripts)."""
    queue = node_queue(check_node(node)) if node else queue or SHARED_QUEUE
    return send_job(app, JobStore(env("TANDEM_REDIS_URL")), request, queue, node)

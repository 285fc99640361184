"""What a worker does at start about the jobs its previous life was running when it died (kill -9,
OOM kill, power loss): each goes back to the head of its queue at once, instead of waiting for
kombu's visibility timeout (hours) while the admin API shows it running.

The job's message is still in kombu's "unacked" hash (acks late: a job is acknowledged only when it
ends). It is found there by the job id and restored with kombu's own ``restore_by_tag``. A job whose
message is gone (Redis lost it) is marked FAILURE with the reason, never left PENDING or running.
"""

from __future__ import annotations

import json

from celery.states import READY_STATES

from services.common.jobs import JobStore
from services.common.logging import get_logger
from services.common.settings import env

log = get_logger("profiler.recovery")


class WorkerLost(RuntimeError):
    """The worker running the job died; the message says what became of the job."""


def unacked_tags(channel, job_ids: set[str]) -> dict[str, str]:
    """Job id -> delivery tag of its unacknowledged message, for the ids in ``job_ids`` that have one."""
    found = {}
    for tag, raw in channel.client.hscan_iter(channel.unacked_key):
        payload = json.loads(raw)[0]
        job_id = payload.get("headers", {}).get("id")
        if job_id in job_ids:
            found[job_id] = tag.decode() if isinstance(tag, bytes) else tag
    return found


def requeue_interrupted(app, hostname: str) -> list[str]:
    """Requeue the jobs ``hostname`` started and never ended; returns their ids. Errors are logged:
    a worker must start even when this cannot be done (kombu's visibility timeout is the fallback)."""
    store = JobStore(env("TANDEM_REDIS_URL"))
    try:
        job_ids = store.interrupted(hostname)
        if not job_ids:
            return []
        with app.connection_for_write() as conn:
            channel = conn.default_channel
            tags = unacked_tags(channel, set(job_ids))
            for job_id in job_ids:
                if job_id in tags:
                    channel.qos.restore_by_tag(tags[job_id], leftmost=True)
                    log.warning("job %s was interrupted (worker %s died mid-job): requeued", job_id, hostname)
                elif app.backend.get_state(job_id) not in READY_STATES:
                    app.backend.mark_as_failure(job_id, WorkerLost(
                        f"worker {hostname} died while running this job and its queued message is gone "
                        f"(was Redis restarted without persistence?); submit it again"))
                    log.warning("job %s was interrupted and its message is gone: marked FAILURE", job_id)
                store.ended(job_id, hostname)
        return job_ids
    except Exception as exc:  # noqa: BLE001 — see the docstring
        log.warning("could not requeue the jobs worker %s was running: %s", hostname, exc)
        return []

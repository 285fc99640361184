"""The admin API (/admin, admin token): profile jobs on the Celery worker, profiles, engine reloads.

    POST /admin/profiles                      start a profiling job -> 202 {"id", "task", "queue", "node", "state"}
                                              body: {"kind": "bw"|"load", "node": the node whose GPUs to
                                              measure (its worker's queue), or "queue": a worker's queue, and
                                              the typed fields of services/common/jobs.py (no CLI flags, no
                                              paths to write: outputs stay in the worker's profiles dir)}
    GET  /admin/jobs/{id}                     {"id", "state", "progress", "result", "error", "attempts", ...};
                                              404 for an id that was never submitted (or has expired)
    GET  /admin/profiles                      the profiles in the gateway's profiles dir ("data") and each
                                              node's, as its worker reported them ("nodes"); ?node=N: N's
    GET  /admin/engines                       the engines behind this gateway and their health
    POST /admin/engines/{id}/reload-profile   the engine re-reads its profile (no restart); id "all": every
                                              engine (one per GPU), 200 {"data": [each engine's answer, or
                                              its error body and "status"]}

Tasks are sent by name (``send_task``) through a minimal Celery client, so the gateway needs neither
torch nor the profiler's code; the worker (services/profiler/app.py) owns the task definitions. Each
job is recorded in Redis before it is sent (services/common/jobs.py): its state combines that record
(submitted, running, progress, attempts) with Celery's end state.
"""

from __future__ import annotations

import asyncio
import time
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from pydantic import TypeAdapter, ValidationError

from services.common.jobs import (SHARED_QUEUE, STALLED_AFTER_S, TASKS, JobRequest, JobStore, check_node, node_queue,
                                  send_job)
from services.common.node_profiles import profile_view, read_reports
from services.common.logging import get_logger
from services.common.settings import redact
from services.gateway.auth import admin_guard
from services.gateway.engines import EngineError, EnginePool
from services.gateway.generation import RequestError
from services.gateway.protocol import error_body

log = get_logger("gateway.admin")

_REQUEST = TypeAdapter(JobRequest)
job_store = lru_cache(maxsize=4)(JobStore)  # one connection pool per Redis URL


@lru_cache(maxsize=4)
def celery_client(redis_url: str):
    """A Celery app used only to send tasks and read their state (same broker/backend as the worker)."""
    from celery import Celery

    app = Celery("tandem-gateway", broker=redis_url, backend=redis_url)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                    result_extended=True, broker_connection_retry_on_startup=False,
                    broker_connection_timeout=5, redis_socket_connect_timeout=5)
    return app


def job_view(job_id: str, record: dict, result) -> dict:
    """One job as JSON: PENDING (queued), STARTED / PROGRESS (running, from the record), SUCCESS /
    FAILURE (Celery's end state)."""
    state, info = result.state, result.info
    out: dict[str, Any] = {"id": job_id, "task": TASKS.get(record.get("kind"), record.get("kind")),
                           "queue": record.get("queue"), "node": record.get("node"),
                           "request": record.get("request"), "state": state,
                           "progress": None, "result": None, "error": None, "attempts": record["attempts"],
                           "worker": record.get("worker"), "stalled": False}
    if state == "SUCCESS":
        out["result"] = info
        out["progress"] = {"fraction": 1.0}
    elif state == "FAILURE":
        out["error"] = f"{type(info).__name__}: {info}" if isinstance(info, BaseException) else str(info)
    elif record["attempts"] > 0:  # a worker has started it
        out["state"] = "PROGRESS" if record.get("progress") else "STARTED"
        out["progress"] = record.get("progress")
        silent_s = time.time() - float(record.get("heartbeat_at") or record.get("started_at") or 0)
        if silent_s > STALLED_AFTER_S:  # its worker died (or lost Redis): say so, the state is its last word
            out["stalled"] = True
            out["error"] = (f"worker {record.get('worker')} has not reported for {silent_s:.0f} s: the job runs "
                            "again when that worker restarts, or when another worker on its queue takes it over "
                            "after the visibility timeout")
    return out


def parse_job_request(body: dict):
    """The typed job request of a POST /admin/profiles body (its ``queue`` and ``node`` taken out); raises
    ValueError(message, param)."""
    if "argv" in body:
        raise ValueError("argv is no longer accepted: CLI flags could make the worker write anywhere. Send the "
                         "typed fields instead (docs/operating.md), e.g. {\"kind\": \"bw\", \"seconds\": 2}", "argv")
    fields = {"kind": "bw", **{k: v for k, v in body.items() if k not in ("queue", "node")}}
    if fields["kind"] not in TASKS:
        raise ValueError(f"kind must be one of {sorted(TASKS)}, got {fields['kind']!r}", "kind")
    try:
        return _REQUEST.validate_python(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"] if p not in ("bw", "load")]
        raise ValueError(f"{'.'.join(loc) or 'body'}: {err['msg']}", loc[0] if loc else None) from None


def job_queue(body: dict) -> tuple[str, str | None]:
    """(queue, node) of a POST /admin/profiles body: ``node`` -> that node's queue; else ``queue``; else the
    shared queue. Raises ValueError(message, param)."""
    node, queue = body.get("node"), body.get("queue")
    if node is not None:
        if not isinstance(node, str):
            raise ValueError("node must be a string (a node name, as `kubectl get nodes` lists it)", "node")
        try:
            node_q = node_queue(check_node(node))
        except ValueError as exc:
            raise ValueError(str(exc), "node") from None
        if queue is not None and queue != node_q:
            raise ValueError(f"give node or queue, not both: node {node!r} is queue {node_q!r}, not {queue!r}", "queue")
        return node_q, node
    queue = queue or SHARED_QUEUE
    if not isinstance(queue, str) or len(queue) > 200:
        raise ValueError("queue must be a string (a worker's host queue)", "queue")
    return queue, None


def create_router(pool: EnginePool, admin_token: str, redis_url: str, profiles_dir: str) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_guard(admin_token))])

    @router.post("/profiles")
    async def start_profile(request: Request):
        body = await _optional_json(request)
        try:
            queue, node = job_queue(body)
            job = parse_job_request(body)
        except ValueError as exc:
            return _error(400, exc.args[0], exc.args[1])
        try:
            job_id = await asyncio.to_thread(send_job, celery_client(redis_url), job_store(redis_url), job, queue,
                                             node)
        except Exception as exc:  # broker down: say which URL (its password masked)
            why = redact(f"cannot reach the job queue at {redis_url}: {exc}", redis_url)
            log.warning("cannot queue %s: %s", TASKS[job.kind], why)
            return _error(503, why, type_="service_unavailable")
        log.info("queued %s job %s on %s", TASKS[job.kind], job_id, queue)
        return JSONResponse({"id": job_id, "task": TASKS[job.kind], "queue": queue, "node": node, "state": "PENDING"},
                            202)

    @router.get("/jobs/{job_id}")
    async def get_job(job_id: str):
        def read():
            record = job_store(redis_url).get(job_id)
            return None if record is None else job_view(job_id, record, celery_client(redis_url).AsyncResult(job_id))

        try:
            view = await asyncio.to_thread(read)
        except Exception as exc:
            return _error(503, redact(f"cannot reach the result backend at {redis_url}: {exc}", redis_url),
                          type_="service_unavailable")
        if view is None:
            return _error(404, f"no job {job_id!r}: never submitted, or expired (jobs are kept 7 days)", "job_id",
                          type_="not_found_error")
        return view

    @router.get("/profiles")
    async def get_profiles(node: str | None = None):
        from services.common.profiles import list_profiles

        try:
            nodes = await asyncio.to_thread(lambda: read_reports(job_store(redis_url).redis))
        except Exception as exc:  # Redis away: the local dir can still be listed
            log.warning("node profiles unreadable: %s", redact(str(exc), redis_url))
            nodes = None
        if node is not None:
            if nodes is None:
                return _error(503, redact(f"cannot reach Redis at {redis_url} for the nodes' profiles", redis_url),
                              type_="service_unavailable")
            if node not in nodes:
                return _error(404, f"no worker has reported profiles for node {node!r} (nodes: "
                              f"{', '.join(nodes) or 'none'})", "node", type_="not_found_error")
            return {"node": node, **nodes[node]}
        entries = await asyncio.to_thread(list_profiles, profiles_dir or None)
        return {"profiles_dir": profiles_dir, "data": [profile_view(e) for e in entries], "nodes": nodes}

    @router.get("/engines")
    async def get_engines():
        return {"data": [{"id": e.client.id, "url": e.client.url, "healthy": e.healthy, "health": e.health,
                          "model_id": e.model_id, "outstanding": e.outstanding} for e in pool.engines]}

    @router.post("/engines/{engine_id}/reload-profile")
    async def reload_profile(engine_id: str):
        if engine_id == "all":  # after a {"gpu": "all"} profile job: each engine reads its own GPU's profile
            return {"data": await asyncio.gather(*(_reload(e) for e in pool.engines))}
        e = pool.by_id(engine_id)
        if e is None:
            return _error(404, f"no engine {engine_id!r} (ids: {', '.join(x.client.id for x in pool.engines)})",
                          "engine_id")
        try:
            return {"engine": e.client.id, **(await e.client.reload_profile())}
        except EngineError as exc:
            return JSONResponse(exc.body, exc.status, headers=exc.headers)

    return router


async def _reload(e) -> dict:
    """One engine's reload-profile answer, or its error body with the status it would have answered."""
    try:
        return {"engine": e.client.id, **(await e.client.reload_profile())}
    except EngineError as exc:
        return {"engine": e.client.id, "status": exc.status, **exc.body}


async def _optional_json(request: Request) -> dict:
    import json

    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON or UTF-8, a 4300+-digit number, nested too deep
        raise RequestError(f"request body is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse(error_body(message, type_, status, param), status)

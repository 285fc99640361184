"""The admin API (/admin, admin token): profile jobs on the Celery worker, profiles, engine reloads.

    POST /admin/profiles                      start a `tandem.bench_bw` job -> {"id", "state"}
                                              body (all optional): {"kind": "bw"|"load", "argv": [CLI flags of
                                              `tandem bench bw|load`], "queue": a host queue}
    GET  /admin/jobs/{id}                     {"id", "state", "progress", "result", "error"}
    GET  /admin/profiles                      the profiles in the shared volume
    GET  /admin/engines                       the engines behind this gateway and their health
    POST /admin/engines/{id}/reload-profile   the engine re-reads its profile (no restart)

Tasks are sent by name (``send_task``) through a minimal Celery client, so the gateway needs neither
torch nor the profiler's code; the worker (services/profiler/app.py) owns the task definitions.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from services.common.logging import get_logger
from services.gateway.auth import admin_guard
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import error_body

log = get_logger("gateway.admin")

BENCH_BW_TASK = "tandem.bench_bw"
BENCH_LOAD_TASK = "tandem.bench_load"
JOB_KINDS = {"bw": BENCH_BW_TASK, "load": BENCH_LOAD_TASK}
SHARED_QUEUE = "tandem.profiler"  # services/profiler/app.py: every worker consumes it (any GPU host)


@lru_cache(maxsize=4)
def celery_client(redis_url: str):
    """A Celery app used only to send tasks and read their state (same broker/backend as the worker)."""
    from celery import Celery

    app = Celery("tandem-gateway", broker=redis_url, backend=redis_url)
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                    result_extended=True, broker_connection_retry_on_startup=False,
                    broker_connection_timeout=5, redis_socket_connect_timeout=5)
    return app


def job_view(result) -> dict:
    """One job as JSON: Celery states PENDING/STARTED/PROGRESS/SUCCESS/FAILURE (+ meta)."""
    state = result.state
    info = result.info
    out: dict[str, Any] = {"id": result.id, "state": state, "progress": None, "result": None, "error": None}
    if state == "SUCCESS":
        out["result"] = info
        out["progress"] = {"fraction": 1.0}
    elif state == "FAILURE":
        out["error"] = f"{type(info).__name__}: {info}" if isinstance(info, BaseException) else str(info)
    elif isinstance(info, dict):  # PROGRESS / STARTED meta from the task's update_state
        out["progress"] = info
    return out


def profile_view(entry) -> dict:
    p = entry.profile
    out: dict[str, Any] = {"path": str(entry.path), "file": entry.path.name, "valid": p is not None,
                           "error": entry.error}
    if p is not None:
        out["profile"] = p.model_dump(mode="json")
    return out


def create_router(pool: EnginePool, admin_token: str, redis_url: str, profiles_dir: str) -> APIRouter:
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_guard(admin_token))])

    @router.post("/profiles")
    async def start_profile(request: Request):
        body = await _optional_json(request)
        kind, argv, queue = body.get("kind", "bw"), body.get("argv", []), body.get("queue") or SHARED_QUEUE
        if kind not in JOB_KINDS:
            return _error(400, f"kind must be one of {sorted(JOB_KINDS)}, got {kind!r}", "kind")
        if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
            return _error(400, "argv must be a list of CLI flags (strings) of `tandem bench bw|load`", "argv")
        if not isinstance(queue, str):
            return _error(400, "queue must be a string", "queue")
        try:
            result = await asyncio.to_thread(celery_client(redis_url).send_task, JOB_KINDS[kind], args=[argv],
                                             queue=queue)
        except Exception as exc:  # broker down: say which URL
            log.warning("cannot queue %s on %s: %s", JOB_KINDS[kind], redis_url, exc)
            return _error(503, f"cannot reach the job queue at {redis_url}: {exc}", type_="service_unavailable")
        log.info("queued %s job %s", JOB_KINDS[kind], result.id)
        return JSONResponse({"id": result.id, "task": JOB_KINDS[kind], "queue": queue, "state": "PENDING"}, 202)

    @router.get("/jobs/{job_id}")
    async def get_job(job_id: str):
        try:
            result = celery_client(redis_url).AsyncResult(job_id)
            return await asyncio.to_thread(job_view, result)
        except Exception as exc:
            return _error(503, f"cannot reach the result backend at {redis_url}: {exc}", type_="service_unavailable")

    @router.get("/profiles")
    async def get_profiles():
        from services.common.profiles import list_profiles

        entries = await asyncio.to_thread(list_profiles, profiles_dir or None)
        return {"profiles_dir": profiles_dir, "data": [profile_view(e) for e in entries]}

    @router.get("/engines")
    async def get_engines():
        return {"data": [{"id": e.client.id, "url": e.client.url, "healthy": e.healthy, "health": e.health,
                          "model_id": e.model_id, "outstanding": e.outstanding} for e in pool.engines]}

    @router.post("/engines/{engine_id}/reload-profile")
    async def reload_profile(engine_id: str):
        e = pool.by_id(engine_id)
        if e is None:
            return _error(404, f"no engine {engine_id!r} (ids: {', '.join(x.client.id for x in pool.engines)})",
                          "engine_id")
        try:
            return {"engine": e.client.id, **(await e.client.reload_profile())}
        except EngineError as exc:
            return JSONResponse(exc.body, exc.status, headers=exc.headers)

    return router


async def _optional_json(request: Request) -> dict:
    import json

    raw = await request.body()
    if not raw.strip():
        return {}
    data = json.loads(raw)  # JSONDecodeError -> the app's 400 handler
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def _error(status: int, message: str, param: str | None = None, type_: str = "invalid_request_error"):
    return JSONResponse(error_body(message, type_, status, param), status)

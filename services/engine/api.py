"""The engine's internal HTTP API (versioned under /engine/v1; /health and /metrics at the root).

    GET  /health                 {"status":"loading","progress":{...}} | {"status":"ok","maintenance":...}
    GET  /metrics                Prometheus text
    GET  /engine/v1/info         model id, max_seq_len, tokenizer.json text, tokenizer/generation config, eos ids
    POST /engine/v1/generate     {request_id, prompt_token_ids, sampling{...}} -> NDJSON lines
                                 {token_ids, finish_reason, prompt_tokens, completion_tokens, cached_tokens
                                  [, stop_token_id][, logprobs]}
                                 (sampling.grammar: {"json_schema": {...}} | {"lark": "..."} constrains
                                 the output; one that does not compile is a 400 naming why)
                                 a client that disconnects aborts the request (its KV slot is freed)
    POST /engine/v1/abort        {request_id[, finish_reason: "abort" (default) | "stop"]} ("stop": the
                                 gateway ended it on a stop string; counted as a finish, not an abort)
    GET  /engine/v1/stats        JSON (throughput, running/waiting, KV use, expert-cache counters, VRAM)
    POST /engine/v1/reload-profile

``sampling`` is runtime/sampler.py's SamplingParams, field for field (unknown fields are a 400 naming
them): max_tokens, temperature, top_p, top_k, min_p, seed, ignore_eos, stop_token_ids, presence_penalty,
frequency_penalty, repetition_penalty, logit_bias {"<token id>": bias}, min_tokens, logprobs (k). With
``logprobs: k`` each output line carries ``logprobs``, one entry per token of ``token_ids``:
{"logprob": the model's log-probability of the token, "top": [[token id, logprob], ...] its k best}.
Fields are only ever added within v1 (a gateway sends a field only when it asks for something, so an
older engine refuses what it cannot do by name instead of ignoring it).

Errors: {"error": {"message", "type", "param", "code"}} with 400 (invalid), 401 (engine token),
413 (body over the limit), 429 (+ Retry-After, queue full), 503 (loading / failed). The engine never
speaks the OpenAI protocol: token ids in, token ids out.

Access (services/engine/guard.py): with TANDEM_ENGINE_TOKEN set, every /engine/v1 route needs
``Authorization: Bearer <token>`` (the gateway sends it); without one, listen on loopback only
(`tandem engine` warns otherwise). Under `tandem serve` the read-only routes (info, stats) sit behind
the API keys and the control routes (generate, abort, reload-profile) behind the engine token, or are
not served at all without one.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.logging import get_logger, setup_logging
from services.common.settings import add_dataclass_arguments, config_or_exit, env
from services.engine.config import EngineConfig
from services.engine.engine import Engine, InvalidRequestError, QueueFullError, RequestStream
from services.engine.engine_status import EngineNotReadyError, Maintenance
from services.engine.guard import (ENGINE_TOKEN_ENV, BodyLimit, BodyTooLarge, body_limit_for, engine_token_guard,
                                   exposed_without_token, too_large)
from services.engine.reports import API_VERSION
from services.engine.runtime.sampler import SamplingParams

log = get_logger("engine.api")

PREFIX = "/engine/v1"
RETRY_AFTER_S = 1


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    """The one error shape of every Tandem HTTP API (OpenAI's)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: Exception):
    """Map the engine's exceptions to HTTP."""
    if isinstance(exc, QueueFullError):
        return JSONResponse(error_body(str(exc), "rate_limit_error", 429), 429,
                            headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineNotReadyError):
        return JSONResponse(error_body(str(exc), "service_unavailable", 503), 503, headers={"Retry-After": "5"})
    if isinstance(exc, (InvalidRequestError, ValueError, TypeError)):
        return JSONResponse(error_body(str(exc), "invalid_request_error", 400), 400)
    raise exc


def create_app(engine: Engine, token: str = "", body_limit: int | None = None) -> FastAPI:
    """The engine service's app over a started (or starting) engine: /health, /metrics, /engine/v1
    (behind ``token`` when given; bodies up to ``body_limit`` bytes, default from max_seq_len)."""
    app = FastAPI(title="Tandem engine", version=API_VERSION)
    app.state.engine = engine
    app.add_middleware(BodyLimit, limit=body_limit or body_limit_for(engine.config.max_seq_len))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), type_, exc.status_code), exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(BodyTooLarge)
    async def body_too_large(_: Request, exc: BodyTooLarge):
        return JSONResponse(too_large(body_limit or body_limit_for(engine.config.max_seq_len)), 413)

    @app.get("/health")
    async def health():
        body = engine.health()
        ok = body.get("status") == "ok" and body.get("maintenance") != "failed"
        return JSONResponse(body, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        from services.engine.metrics import render_metrics

        await engine.refresh_metrics()
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    guard = [Depends(engine_token_guard(token))] if token else []
    app.include_router(create_router(engine, guard))
    app.include_router(create_control_router(engine, guard))
    return app


def create_router(engine: Engine, dependencies: list | None = None) -> APIRouter:
    """The read-only versioned routes (/engine/v1/info, /stats); `tandem serve` mounts them on the
    gateway's port too, behind its API keys."""
    app = APIRouter(dependencies=dependencies or [])

    @app.get(PREFIX + "/info")
    async def info():
        try:
            return engine.info()
        except EngineNotReadyError as exc:
            return error_response(exc)

    @app.get(PREFIX + "/stats")
    async def stats():
        return await engine.stats()

    return app


def create_control_router(engine: Engine, dependencies: list | None = None) -> APIRouter:
    """The routes that act (/engine/v1/generate, /abort, /reload-profile): the gateway's alone."""
    app = APIRouter(dependencies=dependencies or [])

    @app.post(PREFIX + "/abort")
    async def abort(request: Request):
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        if not isinstance(body, dict):
            return JSONResponse(error_body("abort body must be a JSON object", "invalid_request_error", 400), 400)
        try:  # finish_reason "stop": the gateway ended the request on a stop string (a finish, not an abort)
            engine.abort(str(body.get("request_id", "")), body.get("finish_reason", "abort"))
        except ValueError as exc:
            return JSONResponse(error_body(str(exc), "invalid_request_error", 400, "finish_reason"), 400)
        return {"aborted": body.get("request_id")}

    @app.post(PREFIX + "/reload-profile")
    async def reload_profile():
        try:
            return await engine.reload_profile()
        except EngineNotReadyError as exc:
            return error_response(exc)
        except Exception as exc:  # the backend's reload failed: say why, keep serving
            log.exception("profile reload failed")
            return JSONResponse(error_body(f"profile reload failed: {exc}", "server_error", 500), 500)

    @app.post(PREFIX + "/generate")
    async def generate(request: Request):
        body = await _json_body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            request_id, prompt, params = parse_generate(body)
            stream = engine.submit(request_id, prompt, params)
        except Exception as exc:
            return error_response(exc)
        return StreamingResponse(_ndjson(stream), media_type="application/x-ndjson")

    return app


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return JSONResponse(error_body(f"request body is not valid JSON: {exc}", "invalid_request_error", 400), 400)


def parse_generate(body: Any) -> tuple[str, list[int], SamplingParams]:
    """Validate a generate body; ValueError/TypeError name the bad field."""
    if not isinstance(body, dict):
        raise ValueError("generate body must be a JSON object")
    prompt = body.get("prompt_token_ids")
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise ValueError("prompt_token_ids must be a list of integers")
    sampling = body.get("sampling") or {}
    if not isinstance(sampling, dict):
        raise ValueError("sampling must be an object")
    params = SamplingParams.from_dict(sampling)
    return str(body.get("request_id") or uuid.uuid4().hex), prompt, params


async def _ndjson(stream: RequestStream):
    """Yield one JSON line per output; a disconnect (cancellation/close) aborts the request."""
    try:
        async for out in stream:
            yield json.dumps(out) + "\n"
    finally:
        stream.abort()


# -- `tandem engine` --------------------------------------------------------------------------------
def build_parser(prog: str = "tandem engine") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="The Tandem engine alone: loads the model and serves "
                                     "the internal API (/engine/v1, /health, /metrics) for one or more gateways.")
    add_dataclass_arguments(parser, EngineConfig)
    parser.add_argument("--log-level", default=None,
                        help="DEBUG logs each request's summary (default: TANDEM_LOG_LEVEL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    config = config_or_exit("tandem engine", EngineConfig, args)
    from services.engine.preflight import check_model_or_exit  # the model stack: not for --help

    check_model_or_exit("tandem engine", config)
    url = f"http://{config.host}:{config.port}"
    token = env(ENGINE_TOKEN_ENV)
    if warning := exposed_without_token(config.host, token):
        log.warning("%s", warning)
    engine = Engine(config, on_ready=lambda: log.info("ready on %s (model %s, backend %s)", url,
                                                      engine.loaded.model_id, config.moe_backend.value))
    log.info("engine API on http://%s:%d (model %s loading in the background; GET /health for progress)",
             config.host, config.port, config.model)
    return run_until_stopped("tandem engine", create_app(engine, token), engine, config.host, config.port)


def run_until_stopped(prog: str, app: FastAPI, engine: Engine, host: str, port: int, server=None) -> int:
    """Start ``engine`` and serve ``app`` until Ctrl-C / SIGTERM (status 0), or until the model fails to
    load: then the reason on one line of stderr and status 1, so `tandem stack`, compose and other
    supervisors see the failure at once instead of a /health that answers 503 forever. ``server``: a
    uvicorn.Server already configured for ``app`` (`tandem serve`: the gateway's, with its limits)."""
    import uvicorn

    if server is None:
        server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                               timeout_graceful_shutdown=2))
    engine.on_load_failed = lambda: setattr(server, "should_exit", True)
    engine.start()
    try:
        server.run()
    finally:
        engine.shutdown()
    if engine.maintenance is Maintenance.FAILED and engine.loaded is None:
        print(f"{prog}: cannot serve {engine.config.model}: {str(engine.error).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0

"""The OpenAI-compatible gateway: FastAPI app, its config and `tandem gateway`.

Routes: /v1/models[/{id}], /v1/chat/completions, /v1/completions, /tokenize, /detokenize (API keys),
/v1/messages (Anthropic's Messages API, serving_anthropic.py), /admin/... (admin token),
/health (the engines' state: loading progress, then serving), /metrics (Prometheus).
Every error is OpenAI's body {"error": {"message", "type", "param", "code"}}: validation -> 400 (not
FastAPI's 422), bad JSON -> 400, missing/wrong key -> 401, unknown model -> 404, head or body too slow
-> 408, body over --max-body-bytes -> 413, queue full -> 429 + Retry-After, no engine, past
--max-connections or past the shutdown grace -> 503 (limits.py and shutdown.py say what each bound protects).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Awaitable, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.common.logging import get_logger, setup_logging
from services.common.settings import ENV, add_dataclass_arguments, config_or_exit, field, redact_url
from services.gateway import serving_anthropic, serving_chat, serving_completions, serving_tokenize
from services.gateway.admin import create_router as admin_router
from services.gateway.auth import AuthError, api_key_guard
from services.gateway.discovery import DnsEngines, DnsName
from services.gateway.engines import EngineClient, EngineError, EnginePool, HttpEngineClient
from services.gateway.generation import RequestError
from services.gateway.limits import RequestBodyLimits
from services.gateway.metrics import PrometheusMiddleware, render_metrics
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList, error_body
from services.gateway.shutdown import serve

log = get_logger("gateway")


@dataclass
class GatewayConfig:
    engines: str = field("http://127.0.0.1:8001", env="TANDEM_ENGINES", flag="--engine",
                         help="engine URL(s) behind this gateway, comma-separated")
    engines_dns: str = field("", env="TANDEM_ENGINES_DNS",
                             help="http://NAME:PORT: every address NAME resolves to is an engine on PORT (the engines' "
                             "headless Service on Kubernetes), re-resolved every --engines-dns-refresh-s; adds to "
                             "--engine, whose default (a loopback engine) is then left out; empty = --engine only")
    engines_dns_refresh_s: float = field(10.0, help="seconds between lookups of --engines-dns (engines that "
                                         "appeared join, engines that left are retired)")
    host: str = field("127.0.0.1", help="address the gateway listens on")
    port: int = field(8000, help="port the gateway listens on")
    api_keys: str = field("", env="TANDEM_API_KEYS", flag="--api-key", secret=True,
                          help="Bearer key(s) accepted on /v1, comma-separated; empty = no auth")
    admin_token: str = field("", env="TANDEM_ADMIN_TOKEN", secret=True,
                             help="Bearer token for /admin; empty = admin API disabled")
    redis_url: str = field("redis://127.0.0.1:6379/0", env="TANDEM_REDIS_URL",
                           help="Celery broker/backend for profile jobs")
    profiles_dir: str = field("", env="TANDEM_PROFILES_DIR", help="profiles volume listed by GET /admin/profiles")
    health_interval_s: float = field(1.0, help="seconds between health checks of each engine; GET /health "
                                     "answers from the last check (never waits on an engine)")
    # --- what one client may hold (services/gateway/limits.py says what each bound protects) ---
    max_body_bytes: int = field(4 * 1024 * 1024, help="largest request body accepted (larger -> 413)")
    header_timeout_s: float = field(10.0, help="seconds a connection may take to send a request's line and "
                                    "headers (slower -> 408, connection closed)")
    body_timeout_s: float = field(30.0, help="seconds a request may take to send its body once the headers "
                                  "are in (slower -> 408)")
    keep_alive_timeout_s: float = field(5.0, help="seconds an idle keep-alive connection stays open")
    max_connections: int = field(1000, help="open connections (each a file descriptor) past which requests "
                                 "get 503")
    shutdown_grace_s: float = field(30.0, help="on SIGTERM: seconds in-flight requests get to finish; then "
                                    "each stream ends with an error event and [DONE], each other request "
                                    "with a 503 error")

    def __post_init__(self) -> None:
        self.dns_name  # raises ValueError naming a malformed --engines-dns
        for name in ("max_body_bytes", "health_interval_s", "engines_dns_refresh_s", "header_timeout_s", "body_timeout_s",
                     "keep_alive_timeout_s", "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"--shutdown-grace-s must be >= 0, got {self.shutdown_grace_s}")

    @property
    def engine_urls(self) -> list[str]:
        """The static engines. With --engines-dns, --engine's default (one loopback engine, the
        single-host layout) is not assumed: only engines named explicitly are added."""
        if self.engines_dns and self.engines == ENV["TANDEM_ENGINES"].default:
            return []
        return [u.strip() for u in self.engines.split(",") if u.strip()]

    @property
    def dns_name(self) -> DnsName | None:
        return DnsName.parse(self.engines_dns) if self.engines_dns else None

    @property
    def api_key_list(self) -> list[str]:
        return [k.strip() for k in self.api_keys.split(",") if k.strip()]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        where = ".".join(loc) or "body"
        param = param or (where if loc else None)
        if e.get("type") == "extra_forbidden":  # not an OpenAI field, nor a Tandem extension
            parts.append(f"{where}: unknown field; Tandem does not support it (docs/openai-api.md lists every field)")
            continue
        parts.append(f"{where}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, "invalid_request_error", 400, param), 400)

    @app.exception_handler(RequestError)
    async def request_error(_: Request, exc: RequestError):
        return JSONResponse(exc.body, exc.status)

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError):
        return JSONResponse(exc.body, exc.status, headers=exc.headers)

    @app.exception_handler(AuthError)
    async def auth_error(_: Request, exc: AuthError):
        return JSONResponse(exc.body, exc.status, headers=exc.headers)

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(_: Request, exc: json.JSONDecodeError):
        return JSONResponse(error_body(f"request body is not valid JSON: {exc}", "invalid_request_error", 400), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_, exc.status_code), exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error", 500), 500)


def create_app(config: GatewayConfig, clients: list[EngineClient], on_startup=None,
               before_metrics: Callable[[], Awaitable[None]] | None = None) -> FastAPI:
    """The gateway app over ``clients`` (HTTP engine clients, or the in-process one for `tandem serve`).
    ``before_metrics`` runs before each /metrics scrape (`tandem serve`: export the engine's counters)."""
    dns = config.dns_name
    discovery = DnsEngines(dns, config.engines_dns_refresh_s) if dns else None
    pool = EnginePool(clients, config.health_interval_s, discovery, client_factory=discovered_client)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        if on_startup is not None:
            await on_startup(app)
        yield
        await pool.close()

    app = FastAPI(title="Tandem gateway", lifespan=lifespan)
    app.state.config, app.state.pool = config, pool
    app.state.api_key_guard = api_key_guard(config.api_key_list)
    install_error_handlers(app)
    app.add_middleware(PrometheusMiddleware)
    app.add_middleware(RequestBodyLimits, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    v1 = [Depends(app.state.api_key_guard)]

    def label_model(request: Request, model: str) -> None:
        """The model label of this request's metrics: only a model an engine serves (a bounded set),
        never the client's string as sent (3000 random names would make 3000 series)."""
        if model in pool.models():
            request.state.model_name = model

    @app.get("/health")
    async def health():  # the poller's last view: no engine call per request (unauthenticated, cheap)
        engines = [{"id": e.client.id, "url": e.client.url, "healthy": e.healthy, "health": e.health}
                   for e in pool.engines]
        healthy = [e for e in pool.engines if e.healthy]
        if healthy:
            first = healthy[0].health
            return {"status": "ok", "maintenance": first.get("maintenance", "serving"), "engines": engines}
        loading = [e for e in pool.engines if e.health.get("status") == "loading"]
        if loading:
            return JSONResponse({"status": "loading", "progress": loading[0].health.get("progress", {}),
                                 "engines": engines}, 503)
        failed = [e for e in pool.engines if e.health.get("maintenance") == "failed"]
        body = {"status": "ok" if failed else "unavailable", "maintenance": "failed" if failed else None,
                "engines": engines}
        return JSONResponse(body, 503)

    @app.get("/metrics")
    async def metrics():
        if before_metrics is not None:
            await before_metrics()
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    def card(name: str, e) -> ModelCard:
        return ModelCard(id=name, created=int(time.time()), max_model_len=e.info.get("max_seq_len"))

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return ModelList(data=[card(name, e) for name, e in pool.models().items()]).model_dump()

    @app.get("/v1/models/{model:path}", dependencies=v1)
    async def model_card(model: str):
        known = pool.models()
        if model not in known:
            return JSONResponse(error_body(f"The model `{model}` does not exist (served: {', '.join(known) or 'none'})",
                                           "invalid_request_error", "model_not_found", "model"), 404)
        return card(model, known[model]).model_dump()

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat(req: ChatCompletionRequest, request: Request):
        label_model(request, req.model)
        return await serving_chat.create_chat_completion(pool, req, request.is_disconnected)

    @app.post("/v1/completions", dependencies=v1)
    async def completions(req: CompletionRequest, request: Request):
        label_model(request, req.model)
        return await serving_completions.create_completion(pool, req, request.is_disconnected)

    @app.post("/v1/messages")
    async def messages(request: Request):  # checks the key itself: its errors have Anthropic's shape
        return await serving_anthropic.create_message(pool, request, app.state.api_key_guard)

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(req: serving_tokenize.TokenizeRequest):
        return await asyncio.to_thread(serving_tokenize.tokenize, pool, req)  # a 4 MB prompt: seconds of CPU

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(req: serving_tokenize.DetokenizeRequest):
        return serving_tokenize.detokenize(pool, req)

    app.include_router(admin_router(pool, config.admin_token, config.redis_url, config.profiles_dir))
    return app


def discovered_client(url: str) -> HttpEngineClient:
    """The client of an engine found by DNS; its id is ``address:port`` (usable in /admin/engines/{id}/...)."""
    return HttpEngineClient(url, engine_id=url.split("://", 1)[1])


def build_parser(prog: str = "tandem gateway") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="The OpenAI-compatible gateway in front of one or "
                                     "more Tandem engines (`tandem engine`).")
    add_dataclass_arguments(parser, GatewayConfig)
    parser.add_argument("--log-level", default=None, help="log level (default: TANDEM_LOG_LEVEL)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    config = config_or_exit("tandem gateway", GatewayConfig, args)
    clients = [HttpEngineClient(url, engine_id=str(i)) for i, url in enumerate(config.engine_urls)]
    app = create_app(config, clients)
    engines = [redact_url(u) for u in config.engine_urls] + ([f"every address of {config.dns_name}"] if config.dns_name else [])
    log.info("gateway on http://%s:%d -> engines %s (API keys: %s, admin API: %s)", config.host, config.port,
             ", ".join(engines), "on" if config.api_key_list else "off", "on" if config.admin_token else "off")
    serve(app, config)
    return 0


__all__ = ["GatewayConfig", "create_app", "main"]

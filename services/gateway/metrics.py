"""Every Prometheus metric the gateway exports, declared once (vLLM ``v1/metrics/loggers.py`` style).

Torch-free. The gateway wires it with two lines:

    app.add_middleware(PrometheusMiddleware)          # requests by route/status, latency, in flight
    GatewayMetrics.set_engine_health(url, healthy)     # from the engine health checker

and serves ``render_metrics()`` on ``GET /metrics``. Handlers that know the model set
``request.state.model_name`` so the request series carry it (empty otherwise: bad JSON, /health, ...).
"""

from __future__ import annotations

import time

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# No *_created series: they double the exposition and no panel or rule reads them.
disable_created_metrics()

REQUESTS = Counter("tandem_gateway_requests_total",
                   "HTTP requests finished, by route template (not raw path: bounded cardinality) and status.",
                   ["model_name", "route", "status"])
REQUEST_LATENCY = Histogram("tandem_gateway_request_duration_seconds",
                            "Time from request start to the last body byte sent (whole stream for SSE).",
                            ["model_name", "route"],
                            buckets=[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
                                     60.0, 120.0, 300.0, 600.0])
# No route label: the route is known only after routing, and the gauge must go up before that.
REQUESTS_IN_FLIGHT = Gauge("tandem_gateway_requests_in_flight", "Requests being served now.")
ENGINE_UP = Gauge("tandem_gateway_engine_up", "1 when the gateway's last health check of the engine passed.",
                  ["engine"])
ENGINE_OUTSTANDING = Gauge("tandem_gateway_engine_outstanding_requests",
                           "Requests the gateway has in flight at each engine (least-outstanding routing).",
                           ["engine"])

UNMATCHED_ROUTE = "unmatched"  # 404s of unknown paths share one series


class GatewayMetrics:
    """One-line helpers for the gateway's own code (the middleware records the requests)."""

    @staticmethod
    def set_engine_health(engine: str, healthy: bool) -> None:
        """Record the result of a health check of engine URL ``engine``."""
        ENGINE_UP.labels(engine).set(1.0 if healthy else 0.0)

    @staticmethod
    def set_engine_outstanding(engine: str, outstanding: int) -> None:
        ENGINE_OUTSTANDING.labels(engine).set(outstanding)

    @staticmethod
    def forget_engine(engine: str) -> None:
        """An engine left the pool (its DNS name no longer lists it): drop its series, so the engines
        of a name that keeps changing do not pile up as stale series."""
        for gauge in (ENGINE_UP, ENGINE_OUTSTANDING):
            try:
                gauge.remove(engine)
            except KeyError:
                pass

    @staticmethod
    def observe_request(route: str, status: int, seconds: float, model_name: str = "") -> None:
        """One finished request (the middleware calls this; handy for tests and non-ASGI paths)."""
        REQUESTS.labels(model_name, route, str(status)).inc()
        REQUEST_LATENCY.labels(model_name, route).observe(seconds)


class PrometheusMiddleware:
    """Pure ASGI middleware: latency ends at the last body chunk, so streamed responses count in full
    (a ``BaseHTTPMiddleware`` would stop the clock when the headers go out)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = {"code": 500, "done": False}

        def finish() -> None:
            if status["done"]:
                return
            status["done"] = True
            GatewayMetrics.observe_request(_route_of(scope), status["code"], time.perf_counter() - start,
                                           _model_of(scope))

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                finish()

        REQUESTS_IN_FLIGHT.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            REQUESTS_IN_FLIGHT.dec()
            finish()  # client gone mid-stream or an exception: count it with the last status seen


def _route_of(scope) -> str:
    route = scope.get("route")  # set by FastAPI/Starlette routing on the shared scope dict
    return getattr(route, "path", None) or UNMATCHED_ROUTE


def _model_of(scope) -> str:
    state = scope.get("state") or {}
    value = state.get("model_name", "") if isinstance(state, dict) else getattr(state, "model_name", "")
    return str(value or "")


def render_metrics() -> tuple[bytes, str]:
    """The exposition text of this process's metrics and its content type (for ``GET /metrics``)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

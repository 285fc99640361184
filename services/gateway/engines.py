"""Engine clients and routing: the gateway's only way to reach an engine.

- ``HttpEngineClient``: the engine's internal API over HTTP (httpx), generate as an NDJSON stream.
- ``InProcessEngineClient``: the same calls on an ``Engine`` object in this process (`tandem serve`).
- ``EnginePool``: several engines behind one gateway; picks the healthy engine serving the requested
  model with the fewest outstanding requests; a background task polls /health so an engine that went
  down is skipped (503 when none is left) and taken back once it answers again. Besides the static
  list, the engines behind a DNS name (services/gateway/discovery.py) join and leave the pool as the
  name's answer changes.

Both clients raise ``EngineError`` (HTTP status + OpenAI error body) *before* the first output, so the
gateway can still answer with a proper status code; a stream is closed with ``aclose()`` (aborting the
request on the engine when it has not finished).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, AsyncIterator, Callable, Protocol

import httpx

from services.common.logging import get_logger
from services.common.settings import env
from services.common.tokenizer import Tokenizer
from services.gateway.discovery import DnsEngines
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import error_body

log = get_logger("gateway.engines")


class EngineError(Exception):
    """An engine refused a request or could not be reached: ``status`` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "server_error", headers: dict | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, status, param)
        self.headers = headers or {}

    @classmethod
    def from_response(cls, status: int, body: Any, headers: dict) -> "EngineError":
        err = body.get("error", {}) if isinstance(body, dict) else {}
        keep = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
        return cls(status, err.get("message") or f"engine answered HTTP {status}", err.get("type") or "server_error",
                   keep, err.get("param"))


class GenerateStream(Protocol):
    def __aiter__(self) -> AsyncIterator[dict]: ...
    async def aclose(self) -> None: ...


class EngineClient(Protocol):
    id: str
    url: str

    async def health(self) -> dict: ...
    async def info(self) -> dict: ...
    async def stats(self) -> dict: ...
    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: dict) -> GenerateStream: ...
    async def abort(self, request_id: str, finish_reason: str = "abort") -> None: ...
    async def reload_profile(self) -> dict: ...
    async def close(self) -> None: ...


# -- over HTTP ----------------------------------------------------------------------------------------
class _HttpStream:
    def __init__(self, response: httpx.Response):
        self._response = response
        self._finished = False

    async def __aiter__(self):
        try:
            async for line in self._response.aiter_lines():
                if line.strip():
                    out = json.loads(line)
                    self._finished = out.get("finish_reason") is not None
                    yield out
        except httpx.HTTPError as exc:
            raise EngineError(502, f"engine stream broke: {exc}") from exc
        if not self._finished:
            raise EngineError(502, "engine closed the stream before the request finished")

    async def aclose(self) -> None:
        await self._response.aclose()  # closing the connection aborts the request on the engine


class HttpEngineClient:
    """One engine reached over HTTP at ``url`` (its API under /engine/v1)."""

    def __init__(self, url: str, engine_id: str | None = None, timeout_s: float = 10.0, token: str | None = None):
        self.url = url.rstrip("/")
        self.id = engine_id or self.url
        token = env("TANDEM_ENGINE_TOKEN") if token is None else token  # the engine API's own token
        # generate streams may idle for a long time between tokens (queueing, prefill): no read timeout
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, read=None),
                                         limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
                                         headers={"Authorization": f"Bearer {token}"} if token else None)
        self._timeout_s = timeout_s

    async def _get(self, path: str) -> dict:
        try:
            r = await self._client.get(path, timeout=self._timeout_s)
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.id} unreachable: {exc!r}", "service_unavailable") from exc
        body = _json_or_none(r)
        if r.status_code != 200 and not path.endswith("/health"):
            raise EngineError.from_response(r.status_code, body, dict(r.headers))
        return body or {}

    async def health(self) -> dict:
        return await self._get("/health")

    async def info(self) -> dict:
        return await self._get("/engine/v1/info")

    async def stats(self) -> dict:
        return await self._get("/engine/v1/stats")

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: dict) -> GenerateStream:
        body = {"request_id": request_id, "prompt_token_ids": prompt_token_ids, "sampling": sampling}
        try:
            req = self._client.build_request("POST", "/engine/v1/generate", json=body)
            r = await self._client.send(req, stream=True)
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.id} unreachable: {exc!r}", "service_unavailable") from exc
        if r.status_code != 200:
            await r.aread()
            await r.aclose()
            raise EngineError.from_response(r.status_code, _json_or_none(r), dict(r.headers))
        return _HttpStream(r)

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        body = {"request_id": request_id, **({"finish_reason": finish_reason} if finish_reason != "abort" else {})}
        try:
            await self._client.post("/engine/v1/abort", json=body, timeout=self._timeout_s)
        except httpx.HTTPError:
            pass  # the engine is gone: nothing left to abort

    async def reload_profile(self) -> dict:
        try:
            r = await self._client.post("/engine/v1/reload-profile", timeout=300)
        except httpx.HTTPError as exc:
            raise EngineError(503, f"engine {self.id} unreachable: {exc!r}", "service_unavailable") from exc
        body = _json_or_none(r)
        if r.status_code != 200:
            raise EngineError.from_response(r.status_code, body, dict(r.headers))
        return body

    async def close(self) -> None:
        await self._client.aclose()


def _json_or_none(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


# -- in this process (`tandem serve`) -------------------------------------------------------------------
class _InProcessStream:
    def __init__(self, stream):
        self._stream = stream

    def __aiter__(self):
        return self._stream.__aiter__()

    async def aclose(self) -> None:
        self._stream.abort()


class InProcessEngineClient:
    """The engine API's calls made directly on an ``services.engine.engine.Engine`` (no HTTP hop)."""

    def __init__(self, engine, engine_id: str = "local"):
        self.engine = engine
        self.id = engine_id
        self.url = "in-process"

    async def health(self) -> dict:
        return self.engine.health()

    async def info(self) -> dict:
        return self._call(self.engine.info)

    async def stats(self) -> dict:
        return await self.engine.stats()

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: dict) -> GenerateStream:
        from services.engine.runtime.sampler import SamplingParams

        def submit():
            return self.engine.submit(request_id, prompt_token_ids, SamplingParams.from_dict(sampling))

        return _InProcessStream(self._call(submit))

    async def abort(self, request_id: str, finish_reason: str = "abort") -> None:
        self.engine.abort(request_id, finish_reason)

    async def reload_profile(self) -> dict:
        try:
            return await self.engine.reload_profile()
        except EngineError:
            raise
        except Exception as exc:
            self._raise(exc)

    async def close(self) -> None:
        pass

    def _call(self, fn):
        try:
            return fn()
        except Exception as exc:
            self._raise(exc)

    @staticmethod
    def _raise(exc: Exception):
        from services.engine.engine import QueueFullError
        from services.engine.engine_status import EngineNotReadyError
        from services.engine.runtime.scheduler import InvalidRequestError

        if isinstance(exc, QueueFullError):
            raise EngineError(429, str(exc), "rate_limit_error", {"Retry-After": "1"}) from exc
        if isinstance(exc, EngineNotReadyError):
            raise EngineError(503, str(exc), "service_unavailable", {"Retry-After": "5"}) from exc
        if isinstance(exc, (InvalidRequestError, ValueError)):
            raise EngineError(400, str(exc), "invalid_request_error") from exc
        raise EngineError(500, f"engine error: {type(exc).__name__}: {exc}") from exc


# -- routing -------------------------------------------------------------------------------------------
class EngineState:
    """What the pool knows about one engine."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.healthy = False
        self.health: dict = {"status": "unknown"}
        self.info: dict | None = None
        self.tokenizer: Tokenizer | None = None
        self.outstanding = 0

    @property
    def model_id(self) -> str | None:
        return self.info.get("model_id") if self.info else None

    @property
    def names(self) -> list[str]:
        """Every name this engine's model is served under (--served-model-name aliases)."""
        if not self.info:
            return []
        return list(self.info.get("served_model_names") or [self.info.get("model_id")])


class EnginePool:
    """Least-outstanding-requests routing over engines, with background health polling.

    ``clients``: the static engines (never removed). ``discovery``: the engines behind a DNS name,
    re-resolved every ``discovery.refresh_s``; ``client_factory(url)`` makes the client of each engine
    that appears. An engine that leaves the answer is retired: out of routing at once, its client
    closed once its last request has ended."""

    def __init__(self, clients: list[EngineClient], health_interval_s: float = 1.0,
                 discovery: DnsEngines | None = None, client_factory: Callable[[str], EngineClient] | None = None):
        if not clients and discovery is None:
            raise ValueError("the gateway needs at least one engine (--engine URL, TANDEM_ENGINES or --engines-dns)")
        if discovery is not None and client_factory is None:
            raise ValueError("discovery needs a client_factory")
        self.engines = [EngineState(c) for c in clients]
        self.health_interval_s = health_interval_s
        self.discovery, self._client_factory = discovery, client_factory
        self._discovered: dict[str, EngineState] = {}  # url -> state, the engines the DNS name gave
        self._retired: list[EngineState] = []  # left the DNS answer; closed once idle
        self.readers: set[asyncio.Task] = set()  # one per running generation (generation.EngineOutputs)
        self.closing = False  # the shutdown grace is over: no generation may run on
        self._tasks: list[asyncio.Task] = []
        self._turn = 0  # where the next tie among least-outstanding engines starts (round robin)

    async def start(self) -> None:
        if self.discovery is not None:
            await self.discover_once()
            self._tasks.append(asyncio.create_task(self._forever(self.discover_once, self.discovery.refresh_s)))
        await self.poll_once()
        self._tasks.append(asyncio.create_task(self._forever(self.poll_once, self.health_interval_s)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for e in self.engines + self._retired:
            await e.client.close()

    async def _forever(self, step: Callable, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await step()
            except Exception:  # never let the poller die
                log.exception("%s failed", step.__name__)

    async def discover_once(self) -> None:
        """Re-resolve the DNS name: engines that appeared join (healthy after their first check), engines
        that left are retired. The list is replaced, never changed in place: a request iterating over it
        keeps a consistent view."""
        urls = await self.discovery.refresh()
        gone = [url for url in self._discovered if url not in urls]
        new = [url for url in urls if url not in self._discovered]
        if not gone and not new:
            await self._close_idle_retired()
            return
        for url in gone:
            e = self._discovered.pop(url)
            e.healthy = False
            self._retired.append(e)
            GatewayMetrics.forget_engine(e.client.id)
            log.info("engine %s left %s: retired", e.client.id, self.discovery.name)
        added = {url: EngineState(self._client_factory(url)) for url in new}
        self._discovered.update(added)
        await asyncio.gather(*(self._check(e) for e in added.values()))
        self.engines = [e for e in self.engines if e not in self._retired] + list(added.values())
        await self._close_idle_retired()

    async def _close_idle_retired(self) -> None:
        idle = [e for e in self._retired if e.outstanding == 0]
        self._retired = [e for e in self._retired if e.outstanding > 0]
        for e in idle:
            await e.client.close()

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._check(e) for e in self.engines))

    async def _check(self, e: EngineState) -> None:
        try:
            health = await e.client.health()
        except EngineError as exc:
            health = {"status": "down", "error": str(exc)}
        ok = health.get("status") == "ok" and health.get("maintenance") in ("serving", "reloading")
        if ok and (e.info is None or not e.healthy):  # (re)read info: a restarted engine may serve another model
            try:
                e.info = await e.client.info()
                e.tokenizer = Tokenizer.from_info(e.info)
            except (EngineError, ValueError) as exc:
                log.warning("engine %s: cannot read its info: %s", e.client.id, exc)
                ok = False
        if ok != e.healthy:
            log.info("engine %s is %s (%s)", e.client.id, "healthy" if ok else "unavailable",
                     health.get("maintenance") or health.get("status"))
        e.health, e.healthy = health, ok
        GatewayMetrics.set_engine_health(e.client.id, ok)

    def end_generations(self) -> None:
        """The gateway's shutdown grace is over: end every generation still running (each ends as its
        client can read it: an error event + [DONE], or a 503 error JSON)."""
        self.closing = True
        for reader in list(self.readers):
            reader.cancel()

    def mark_down(self, e: EngineState, why: str) -> None:
        if e.healthy:
            log.warning("engine %s taken out of rotation: %s", e.client.id, why)
        e.healthy = False
        e.health = {"status": "down", "error": why}
        GatewayMetrics.set_engine_health(e.client.id, False)

    def models(self) -> dict[str, EngineState]:
        """Known model names (every alias) -> one engine state holding its info (healthy or not)."""
        out: dict[str, EngineState] = {}
        for e in self.engines:
            for name in e.names:
                if name not in out or e.healthy:
                    out[name] = e
        return out

    def pick(self, model: str, exclude: set[int] = frozenset()) -> EngineState:
        """The healthy engine serving ``model`` with the fewest outstanding requests, leaving out the
        engines whose ``id()`` is in ``exclude`` (already tried by this request). Ties go round robin:
        requests sent one at a time (each finished before the next) find every engine at 0 outstanding,
        and would otherwise all land on the first engine, leaving the other GPUs idle.

        Raises EngineError 404 for a model no engine ever served (when every engine has been seen),
        503 when the model's engines are all unavailable."""
        known = self.models()
        if model not in known:
            if self.engines and all(e.info is not None for e in self.engines):
                raise EngineError(404, f"The model `{model}` does not exist (served: {', '.join(known) or 'none'})",
                                  "invalid_request_error", param="model")
            raise EngineError(503, f"no engine is available to serve `{model}` (engines down or loading)",
                              "service_unavailable", {"Retry-After": "5"})
        candidates = [e for e in self.engines if e.healthy and model in e.names and id(e) not in exclude]
        if not candidates:
            raise EngineError(503, f"every engine serving `{model}` is unavailable; retry later",
                              "service_unavailable", {"Retry-After": "5"})
        least = min(e.outstanding for e in candidates)
        tied = [e for e in candidates if e.outstanding == least]
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen

    def by_id(self, engine_id: str) -> EngineState | None:
        for i, e in enumerate(self.engines):
            if engine_id in (e.client.id, str(i)):
                return e
        return None


def new_request_id() -> str:
    return uuid.uuid4().hex

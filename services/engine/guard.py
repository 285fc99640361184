"""Who may call the engine's internal API, and how much they may send (docs/operating.md).

    engine_token_guard(token)   FastAPI dependency: ``Authorization: Bearer <TANDEM_ENGINE_TOKEN>``
    BodyLimit(app, limit)       ASGI middleware: 413 for a body over ``limit`` bytes
    exposed_without_token(...)  the warning `tandem engine` logs when it listens beyond loopback open

The engine's routes generate, abort any request by id and reload the profile: they belong to the
gateway, not to its clients. With a token set every /engine/v1 route needs it (/health and /metrics
stay open for health checks and Prometheus); without one the engine should listen on loopback only.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from fastapi import HTTPException, Request

ENGINE_TOKEN_ENV = "TANDEM_ENGINE_TOKEN"


def engine_token_guard(token: str):
    """A dependency requiring the engine token (constant-time compare); 401 in the error shape."""
    async def require_engine_token(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise HTTPException(401, f"the engine's internal API needs its own token ({ENGINE_TOKEN_ENV}); "
                                     "an API key is not it", headers={"WWW-Authenticate": "Bearer"})
    return require_engine_token


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: may resolve to anything


def exposed_without_token(host: str, token: str) -> str | None:
    """The warning for an engine API reachable beyond this host with no token, else None."""
    if token or is_loopback(host):
        return None
    return (f"the engine API listens on {host} without {ENGINE_TOKEN_ENV}: anyone who reaches this port can "
            f"generate, abort any request and reload the profile. Set {ENGINE_TOKEN_ENV} (the gateway sends it) "
            "or listen on 127.0.0.1")


UNKNOWN_CONTEXT = 1 << 18  # tokens assumed while --max-seq-len waits for the model's own (before loading)


def body_limit_for(max_seq_len: int | None) -> int:
    """Largest request body the engine accepts: a generate body of max_seq_len token ids (each at
    most ~12 bytes as JSON) plus 64 KiB of sampling parameters and ids."""
    return 64 * 1024 + 12 * (max_seq_len or UNKNOWN_CONTEXT)


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Pure ASGI middleware: 413 before reading a body whose Content-Length is over ``limit``; a body
    without one (chunked) raises ``BodyTooLarge`` while read once it passes ``limit``."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            body = json.dumps(too_large(self.limit)).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            return await send({"type": "http.response.body", "body": body})
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise BodyTooLarge()
            return message

        await self.app(scope, counting_receive, send)


def too_large(limit: int) -> dict:
    return {"error": {"message": f"request body exceeds the engine's limit of {limit} bytes (from --max-seq-len)",
                      "type": "invalid_request_error", "param": None, "code": 413}}

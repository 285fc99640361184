"""Bearer authentication: API keys on /v1, /tokenize, /detokenize (none configured = open; ``x-api-key``
accepted too, for Anthropic clients), one admin token on /admin (none configured = the admin API is
disabled). Errors in OpenAI's shape (/v1/messages turns them into Anthropic's)."""

from __future__ import annotations

import hmac

from fastapi import Request

from services.gateway.protocol import error_body


class AuthError(Exception):
    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, "invalid_request_error", code)
        self.headers = {"WWW-Authenticate": "Bearer"} if status == 401 else {}


def _bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _api_key(request: Request) -> str | None:
    """The Bearer token, else the ``x-api-key`` header (how Anthropic clients send their key)."""
    return _bearer(request) or request.headers.get("x-api-key", "").strip() or None


def _matches(token: str, allowed: list[str]) -> bool:
    # compare against every key (constant time per key) so timing does not reveal which prefix matched
    return any([hmac.compare_digest(token.encode(), key.encode()) for key in allowed])


def api_key_guard(keys: list[str]):
    """A FastAPI dependency enforcing ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``) when
    ``keys`` is not empty."""
    async def require_api_key(request: Request) -> None:
        if not keys:
            return
        token = _api_key(request)
        if token is None:
            raise AuthError(401, "Missing API key: send 'Authorization: Bearer <key>' (or 'x-api-key: <key>')",
                            "missing_api_key")
        if not _matches(token, keys):
            raise AuthError(401, "Incorrect API key provided", "invalid_api_key")
    return require_api_key


def admin_guard(token: str):
    """A FastAPI dependency for /admin: the admin token, never an API key."""
    async def require_admin(request: Request) -> None:
        if not token:
            raise AuthError(403, "the admin API is disabled: start the gateway with --admin-token "
                                 "(or TANDEM_ADMIN_TOKEN)", "admin_disabled")
        given = _bearer(request)
        if given is None or not _matches(given, [token]):
            raise AuthError(401, "Missing or incorrect admin token", "invalid_admin_token")
    return require_admin

"""What one client may hold of the gateway: bytes, seconds and connections.

Each bound below protects the event loop and the process's memory from one slow or hostile client;
every refusal is OpenAI's error JSON.

- ``RequestBodyLimits`` (ASGI middleware): the whole body is read before any handler runs, within
  ``max_bytes`` (else 413) and ``timeout_s`` from the end of the request head (else 408). Without the
  deadline a client sending one byte a minute holds a connection and a task for ever; without the
  byte limit a body is buffered into memory before any check.
- ``bounded_h11_protocol``: uvicorn's h11 protocol plus a deadline for the request head (a connection
  whose request line and headers are not complete within ``header_timeout_s`` gets 408 and is
  closed: slow-header connections otherwise stay open as long as the client trickles bytes) and a
  cap on open connections (uvicorn's ``limit_concurrency``, answered here as JSON 503 instead of
  uvicorn's plain text, so a flood of connections meets a clear refusal instead of exhausting file
  descriptors).
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.protocol import error_body

# uvicorn's own bound on an unfinished request head (h11's default, 16 KiB): a larger head is refused
# with 400 before it is buffered further.
MAX_HEAD_BYTES = 16 * 1024


def _json_bytes(status: int, message: str, type_: str) -> bytes:
    return json.dumps(error_body(message, type_, status)).encode()


async def send_json(send, status: int, body: bytes, close: bool = True) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:  # the client may still be sending a body we will not read: do not reuse the connection
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestBodyLimits:
    """Pure ASGI middleware: buffer the request body within ``max_bytes`` and ``timeout_s`` (413 / 408),
    then run the app with a ``receive`` that hands it the buffered body (and later the disconnect)."""

    def __init__(self, app, max_bytes: int, timeout_s: float):
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def _too_large(self) -> bytes:
        return _json_bytes(413, f"request body exceeds the gateway's limit of {self.max_bytes} bytes "
                                "(--max-body-bytes)", "invalid_request_error")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await send_json(send, 413, self._too_large())
        chunks, seen = [], 0
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":  # client gone before the body ended
                        return
                    chunk = message.get("body", b"")
                    seen += len(chunk)
                    if seen > self.max_bytes:
                        return await send_json(send, 413, self._too_large())
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await send_json(send, 408, _json_bytes(
                408, f"request body not received within {self.timeout_s:g} s (--body-timeout-s)",
                "invalid_request_error"))
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only http.disconnect comes

        await self.app(scope, replay, send)


def bounded_h11_protocol(header_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's ``H11Protocol`` with a deadline on each request head and a JSON 503 past
    ``limit_concurrency`` (pass the class as ``uvicorn.Config(http=...)``)."""
    timeout_body = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
                    b"content-length: %d\r\n\r\n")
    timeout_json = _json_bytes(408, f"request head not received within {header_timeout_s:g} s "
                                    "(--header-timeout-s)", "invalid_request_error")
    busy_json = _json_bytes(503, "the gateway has reached its connection limit (--max-connections); retry later",
                            "service_unavailable")

    class BoundedH11Protocol(H11Protocol):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._head_timer: asyncio.TimerHandle | None = None
            self._cap, self.limit_concurrency = self.limit_concurrency, None  # checked in _app below
            self._inner_app, self.app = self.app, self._app

        async def _app(self, scope, receive, send):
            # uvicorn's own limit_concurrency check, moved here to answer JSON (the task is already counted)
            if self._cap is not None and (len(self.connections) > self._cap or len(self.tasks) > self._cap):
                self.logger.warning("connection limit %d reached: 503", self._cap)
                return await send_json(send, 503, busy_json)
            return await self._inner_app(scope, receive, send)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch_head()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()  # keep-alive: uvicorn's timeout_keep_alive covers the idle wait
            self._stop_head_timer()

        def connection_lost(self, exc) -> None:
            self._stop_head_timer()
            super().connection_lost(exc)

        def _watch_head(self) -> None:
            """A head is being awaited while h11 has no request yet (their_state IDLE) and bytes of one
            came (or the connection is new): arm the deadline once; a complete head disarms it."""
            waiting = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
            if not waiting:
                self._stop_head_timer()
            elif self._head_timer is None and (self.cycle is None or self.conn.trailing_data[0]):
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _stop_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            self.transport.write(timeout_body % len(timeout_json) + timeout_json)
            self.transport.close()

    return BoundedH11Protocol

"""Running the gateway under uvicorn, and stopping it without cutting users off.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections, closes the idle ones and waits for the
requests in flight. They get ``--shutdown-grace-s`` to finish on their own; when the grace is over
``EnginePool.end_generations`` ends every generation still running as a client can read it: a
stream with an error event and ``data: [DONE]``, a non-streamed request with a 503 error JSON. uvicorn's own graceful-shutdown timeout, FLUSH_S later, is
only the backstop that cancels whatever is left.
"""

from __future__ import annotations

import asyncio

import uvicorn

from services.common.logging import get_logger
from services.gateway.limits import MAX_HEAD_BYTES, bounded_h11_protocol

log = get_logger("gateway.shutdown")

FLUSH_S = 5.0  # after the grace: time for the error events to reach the clients before uvicorn cancels


class DrainingServer(uvicorn.Server):
    """uvicorn's server that, once it starts shutting down, ends ``pool``'s generations after ``grace_s``."""

    def __init__(self, config: uvicorn.Config, pool, grace_s: float):
        super().__init__(config)
        self.pool, self.grace_s = pool, grace_s

    async def shutdown(self, sockets=None) -> None:
        in_flight = len(self.server_state.tasks)
        log.info("shutting down: %d request(s) in flight get %g s to finish (--shutdown-grace-s)", in_flight,
                 self.grace_s)
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _grace_over(self) -> None:
        if self.server_state.tasks:
            log.warning("shutdown grace over: ending %d request(s) with an error", len(self.server_state.tasks))
        self.pool.end_generations()


def gateway_server(app, config) -> DrainingServer:
    """The uvicorn server of ``app`` (the gateway, ``create_app``) with ``config``'s (GatewayConfig) limits."""
    uv = uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning",
        http=bounded_h11_protocol(config.header_timeout_s),  # h11 + a deadline on each request head
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        limit_concurrency=config.max_connections,
        timeout_keep_alive=config.keep_alive_timeout_s,
        timeout_graceful_shutdown=config.shutdown_grace_s + FLUSH_S,
    )
    return DrainingServer(uv, app.state.pool, config.shutdown_grace_s)


def serve(app, config) -> None:
    """Serve the gateway ``app`` until SIGTERM / Ctrl-C, then drain it (``tandem gateway``)."""
    gateway_server(app, config).run()

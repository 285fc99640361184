"""Free TCP ports for the deploy tests' subprocesses."""

from __future__ import annotations

import socket


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 now (all bound at once, so no duplicates)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports

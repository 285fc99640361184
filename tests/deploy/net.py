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


def free_port_run(n: int, exclude: tuple[int, ...] = ()) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1 now, none in ``exclude`` (engine i of
    `tandem stack --engines N` listens on --engine-port + i)."""
    for _ in range(100):
        (base,) = free_ports(1)
        run = range(base, base + n)
        if base + n > 65536 or set(run) & set(exclude):
            continue
        socks = []
        try:
            for port in run:
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports found")

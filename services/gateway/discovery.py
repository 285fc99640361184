"""Engines found by DNS: every address one name resolves to is an engine (`--engines-dns`).

On Kubernetes the name is the engines' headless Service (`clusterIP: None`): its DNS answer holds the
address of every ready engine pod, so engines that start, stop or move are found without a static
list. The name is resolved through the system resolver (getaddrinfo: /etc/hosts, then the resolv.conf
nameservers, i.e. the cluster DNS in a pod) every ``refresh_s``; ``EnginePool`` adds the engines that
appeared and retires the ones that left (services/gateway/engines.py). An engine that is still listed
but not answering is ejected by the pool's health checks, exactly like a static one.

A failed lookup keeps the last answer: a DNS hiccup must not empty the pool (the health checks still
take out engines that are really gone).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.common.logging import get_logger

log = get_logger("gateway.discovery")


@dataclass(frozen=True)
class DnsName:
    """``http://NAME:PORT`` (or ``NAME:PORT``): the engines listen on PORT at each address of NAME."""

    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> "DnsName":
        """Raises ValueError naming what is wrong (the gateway's config turns it into a one-line error)."""
        parts = urlsplit(spec if "://" in spec else f"http://{spec}")
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"--engines-dns: scheme must be http or https, got {parts.scheme!r} in {spec!r}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or parts.path not in ("", "/") or parts.username:
            raise ValueError(f"--engines-dns must be http://NAME:PORT (the engines' port), got {spec!r}")
        return cls(parts.scheme, parts.hostname, port)

    def url(self, address: str) -> str:
        shown = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
        return f"{self.scheme}://{shown}:{self.port}"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"


async def resolve(name: DnsName) -> list[str]:
    """The engine URLs ``name`` stands for now, sorted; raises OSError (socket.gaierror) when the name
    does not resolve."""
    infos = await asyncio.get_running_loop().getaddrinfo(name.host, name.port, type=socket.SOCK_STREAM)
    return sorted({name.url(info[4][0]) for info in infos})


class DnsEngines:
    """The engine URLs behind one DNS name, with the last good answer kept across failed lookups."""

    def __init__(self, name: DnsName, refresh_s: float):
        self.name = name
        self.refresh_s = refresh_s
        self.urls: list[str] = []
        self._failing = False

    async def refresh(self) -> list[str]:
        try:
            urls = await resolve(self.name)
        except OSError as exc:
            if not self._failing:  # once per outage, not every refresh
                log.warning("cannot resolve %s (%s); keeping its %d known engine(s)", self.name, exc, len(self.urls))
            self._failing = True
            return self.urls
        if self._failing:
            log.info("%s resolves again", self.name)
        self._failing = False
        if urls != self.urls:
            log.info("%s -> %s", self.name, ", ".join(urls) or "no address")
        self.urls = urls
        return urls

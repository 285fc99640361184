"""Hosts made of Linux network namespaces, for tests/deploy/test_multi_host.py (root, iproute2).

    test process (root namespace) ──veth── ctl ──veth── host-a
                   10.N.0.1     10.N.0.2  │ 10.N.1.1    10.N.1.2
                                          └──veth── host-b
                                            10.N.2.1    10.N.2.2

``ctl`` plays the control plane (Redis, the gateway); each other namespace is a GPU host (an engine and a
worker). Every link is point to point, so nothing is routed and the root namespace's own network is
untouched but for one veth. Processes run under `ip netns exec`, which also bind-mounts
``/etc/netns/<namespace>/hosts`` over /etc/hosts: that file is the namespace's DNS (``set_hosts``), read
again by the system resolver at each lookup.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")


def free_subnet() -> int:
    """N of a 10.N.0.0/16 that no route of the root namespace touches."""
    routes = subprocess.run(["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True).stdout
    start = 100 + os.getpid() % 100  # concurrent runs on one machine start from different places
    for n in [*range(start, 250), *range(100, start)]:
        if f"10.{n}." not in routes:
            return n
    raise RuntimeError("no free 10.N.0.0/16 for the test's links")


class NsProcess:
    """A command in a namespace, in its own process group, output to ``log``."""

    def __init__(self, ns: str, cmd: list[str], env: dict, log: Path, cwd: Path):
        self.log_path = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, cwd=cwd, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, grace_s: float = 10) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()


class Lan:
    """The namespaces ``ctl`` and one per name in ``hosts``; ``address(name)`` is each one's address as
    ``ctl`` reaches it (``ctl`` itself: as the test reaches it)."""

    def __init__(self, tag: str, hosts: list[str]):
        self.tag, self.hosts, self.n = tag, hosts, free_subnet()
        self.ns = {name: f"{tag}-{name}" for name in ["ctl", *hosts]}
        self.root_link = f"{tag}-r"
        self.processes: list[NsProcess] = []
        try:
            for ns in self.ns.values():
                ip("netns", "add", ns)
                ip("-n", ns, "link", "set", "lo", "up")
                (Path("/etc/netns") / ns).mkdir(parents=True, exist_ok=True)
                (Path("/etc/netns") / ns / "resolv.conf").write_text("")  # no nameserver: names come from hosts
            self.set_hosts("ctl", {})
            self._link(None, "ctl", 0)
            for i, host in enumerate(hosts, 1):
                self._link("ctl", host, i)
        except BaseException:
            self.close()
            raise

    def _link(self, left: str | None, right: str, i: int) -> None:
        """A veth pair: 10.N.i.1 on ``left`` (None: the root namespace), 10.N.i.2 on ``right``."""
        a, b = (self.root_link, f"{self.tag}-{i}b") if left is None else (f"{self.tag}-{i}a", f"{self.tag}-{i}b")
        ip("link", "add", a, "type", "veth", "peer", "name", b)
        ip("link", "set", b, "netns", self.ns[right])
        ip("-n", self.ns[right], "addr", "add", f"10.{self.n}.{i}.2/24", "dev", b)
        ip("-n", self.ns[right], "link", "set", b, "up")
        if left is None:
            ip("addr", "add", f"10.{self.n}.{i}.1/24", "dev", a)
            ip("link", "set", a, "up")
        else:
            ip("link", "set", a, "netns", self.ns[left])
            ip("-n", self.ns[left], "addr", "add", f"10.{self.n}.{i}.1/24", "dev", a)
            ip("-n", self.ns[left], "link", "set", a, "up")

    def address(self, name: str) -> str:
        return f"10.{self.n}.{0 if name == 'ctl' else self.hosts.index(name) + 1}.2"

    def ctl_address_for(self, host: str) -> str:
        """``ctl``'s address on the link to ``host`` (how that host reaches Redis)."""
        return f"10.{self.n}.{self.hosts.index(host) + 1}.1"

    def set_hosts(self, name: str, entries: dict[str, list[str]]) -> None:
        """Rewrite namespace ``name``'s /etc/hosts in place (the bind mount follows the file's inode, so
        an atomic rename would not be seen by processes already running)."""
        lines = ["127.0.0.1 localhost"] + [f"{a} {host}" for host, addrs in entries.items() for a in addrs]
        with open(Path("/etc/netns") / self.ns[name] / "hosts", "w") as f:
            f.write("\n".join(lines) + "\n")

    def run(self, name: str, cmd: list[str], env: dict, log: Path, cwd: Path) -> NsProcess:
        self.processes.append(NsProcess(self.ns[name], cmd, env, log, cwd))
        return self.processes[-1]

    def close(self) -> None:
        for p in self.processes:
            p.stop(grace_s=5)
        for ns in self.ns.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # its veth ends go with it
            for f in ("hosts", "resolv.conf"):
                (Path("/etc/netns") / ns / f).unlink(missing_ok=True)
            try:
                (Path("/etc/netns") / ns).rmdir()
            except OSError:
                pass
        subprocess.run(["ip", "link", "del", self.root_link], capture_output=True)

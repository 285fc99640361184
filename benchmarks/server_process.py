"""Start and stop a real `tandem serve` for a benchmark: its own process group, /health polling, and a
stop that always frees the GPU (SIGTERM, grace, SIGKILL, then a pause for the driver to reclaim VRAM)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """`python -m services.cli ARGS` in its own process group (its children die with it), stdout and
    stderr to ``log_path``; ``start()`` again after a stop or kill restarts it, appending to the log."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None):
        self.args, self.log_path, self.cwd = args, log_path, cwd
        self.env = env if env is not None else dict(os.environ, PYTHONUNBUFFERED="1")
        self.cmd = [sys.executable, "-m", "services.cli", *args]
        self.command = " ".join(self.cmd)
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        self._log = open(self.log_path, "a" if self.proc is not None else "w")
        self.proc = subprocess.Popen(self.cmd, cwd=self.cwd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0, pause_s: float = 0.0) -> None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; then wait ``pause_s`` if it was running."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            time.sleep(pause_s)
        self._log.close()

    def kill(self) -> None:
        """Hard stop (a server that crashes)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class ServerProcess(ServiceProcess):
    """`tandem serve ARGS` on 127.0.0.1 and a free port, for a benchmark."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        super().__init__(["serve", *args, "--host", "127.0.0.1", "--port", str(self.port)], log_path)

    def wait_ready(self, timeout_s: float) -> None:
        """Poll /health until the engine reports maintenance == serving; raise with the log tail otherwise."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} while loading:\n{self.log_tail()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=5).json()
                if health.get("status") == "ok" and health.get("maintenance") == "serving":
                    return
                if health.get("maintenance") == "failed":
                    raise RuntimeError(f"engine failed to start: {health}\n{self.log_tail()}")
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 90.0, pause_s: float = 3.0) -> None:
        """As ServiceProcess.stop, then a pause for the driver to reclaim VRAM before the next server."""
        super().stop(grace_s, pause_s)

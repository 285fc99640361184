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


class ServerProcess:
    """`python -m services.cli serve ARGS --port P`, logs to ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "services.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.command = " ".join(cmd)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))

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

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self, grace_s: float = 90.0, vram_pause_s: float = 3.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
            time.sleep(vram_pause_s)  # let the driver reclaim VRAM before the next backend starts
        self._log.close()

"""Fixtures shared by the service tests: real processes on free ports (no mocks of what is tested).

    free_port()                       a TCP port nobody listens on
    demo_dir (session)                TANDEM_DEMO_DIR for every subprocess (the demo checkpoint, written once)
    redis_server (session)            a real redis-server on a free port -> its URL
    celery_worker (session)           `celery -A services.profiler.app worker` against redis_server
                                      -> (env, profiles dir, queue), the same shape as tests/profiler's
    engine_process / gateway_process  factories: start `tandem engine` / `tandem gateway` (or `tandem serve`)
                                      subprocesses, wait for /health, stop them at teardown
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import ServiceProcess, free_port as free_port_now

ROOT = Path(__file__).resolve().parents[1]


class TandemProcess(ServiceProcess):
    """A `tandem KIND ...` subprocess of the tests on 127.0.0.1:``port`` (benchmarks/server_process.py
    starts, stops and restarts it)."""

    def __init__(self, args: list[str], log_path: Path, env: dict, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        super().__init__(args, log_path, env=env, cwd=ROOT)

    def wait_healthy(self, timeout_s: float = 120.0) -> dict:
        """Poll GET /health until it answers 200 with status ok (raise with the log tail otherwise)."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
                last = r.text
                if r.status_code == 200 and r.json().get("status") == "ok":
                    return r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.args[0]} not healthy after {timeout_s} s (last: {last}):\n{self.log_tail()}")


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    return free_port_now()


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("demo")


@pytest.fixture(scope="session")
def service_env(demo_dir, tmp_path_factory) -> dict:
    """Environment for every service subprocess: the session's demo dir and profiles dir."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TANDEM_DEMO_DIR=str(demo_dir),
               TANDEM_PROFILES_DIR=str(tmp_path_factory.mktemp("profiles")), TANDEM_LOG_LEVEL="INFO")
    for name in ("TANDEM_API_KEYS", "TANDEM_ADMIN_TOKEN", "TANDEM_ENGINES"):
        env.pop(name, None)
    return env


def _processes(kind: str, tmp_path_factory, service_env):
    """Body of the process-factory fixtures: yields ``start(*args, port=, wait=, env=)`` and stops every
    process it started when the fixture ends."""
    started: list[TandemProcess] = []

    def start(*args: str, port: int | None = None, wait: bool = True, env: dict | None = None) -> TandemProcess:
        port = port or free_port_now()
        log_path = tmp_path_factory.mktemp(kind) / f"{kind}-{port}.log"
        p = TandemProcess([kind, *args, "--host", "127.0.0.1", "--port", str(port)], log_path,
                           {**service_env, **(env or {})}, port)
        started.append(p)
        if wait:
            p.wait_healthy()
        return p

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="module")
def engine_process(tmp_path_factory, service_env):
    """Factory: ``engine_process("--model", "demo", ...)`` -> a healthy `tandem engine` subprocess."""
    yield from _processes("engine", tmp_path_factory, service_env)


@pytest.fixture(scope="module")
def gateway_process(tmp_path_factory, service_env):
    """Factory: ``gateway_process("--engine", url, ...)`` -> a healthy `tandem gateway` subprocess."""
    yield from _processes("gateway", tmp_path_factory, service_env)


@pytest.fixture(scope="module")
def serve_process(tmp_path_factory, service_env):
    """Factory: ``serve_process("--model", "demo", ...)`` -> a healthy `tandem serve` subprocess."""
    yield from _processes("serve", tmp_path_factory, service_env)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free port (no persistence) -> ``redis://127.0.0.1:PORT/0``."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed (scripts/setup-system.sh installs it)"
    port = free_port_now()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"redis-server did not start on port {port}")
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="session")
def celery_worker(redis_server, tmp_path_factory):
    """A real `celery -A services.profiler.app worker` subprocess on ``redis_server``.
    Yields (env the worker runs with, its profiles dir, its host queue name)."""
    from celery import Celery

    profiles = tmp_path_factory.mktemp("profiles")
    queue = f"tandem.test-{os.getpid()}"
    env = dict(os.environ, TANDEM_REDIS_URL=redis_server, TANDEM_PROFILES_DIR=str(profiles),
               TANDEM_PROFILER_QUEUE=queue, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    log_path = tmp_path_factory.mktemp("worker") / "worker.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "services.profiler.app", "worker",
                             "--loglevel", "INFO", "--pool", "prefork", "--concurrency", "1",
                             "--without-gossip", "--without-mingle", "--without-heartbeat",
                             "-n", f"test-{os.getpid()}@%h"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    probe = Celery(broker=redis_server, backend=redis_server)
    deadline = time.monotonic() + 60
    while not probe.control.ping(timeout=0.5):
        if proc.poll() is not None:
            raise RuntimeError(f"celery worker exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        assert time.monotonic() < deadline, f"celery worker did not answer ping in 60 s; log: {log_path}"
    yield env, profiles, queue
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    log.close()

"""Fixtures shared by the service tests: real processes on free ports (no mocks of what is tested).

    free_port()                       a TCP port nobody listens on
    demo_dir (session)                TANDEM_DEMO_DIR for every subprocess (the demo checkpoint, written once)
    redis_server (session)            a real redis-server on a free port, as the stack runs it -> its URL
    redis_process                     factory: a RedisServer of one test (stop / kill / start again)
    celery_worker (session)           `celery -A services.profiler.app worker` against redis_server
                                      -> (env, profiles dir, queue), the same shape as tests/profiler's
    worker_process                    factory: a CeleryWorker of one test (kill -9 / start again)
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
import torch

# Without a GPU the Triton kernels run under the interpreter. TRITON_INTERPRET must be set before triton is
# first imported by anything (a test module collected earlier that imports a kernel module fixes the mode
# for the whole process), so it is set here, before any test module is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


class RedisServer:
    """redis-server on 127.0.0.1:``port`` started exactly as `tandem stack` starts it (append-only file
    in ``data_dir``); ``stop``/``kill`` and ``start`` again keep the port and the data."""

    def __init__(self, data_dir: Path, port: int | None = None):
        from services.local_stack import redis_command

        assert shutil.which("redis-server"), "redis-server is not installed (scripts/setup-system.sh installs it)"
        self.port = port or free_port_now()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.cmd = redis_command(self.port, data_dir)
        self.log_path = data_dir / "redis.log"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        """SIGTERM: redis's own shutdown (flushes the append-only file)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free port, persistent as the stack runs it -> ``redis://127.0.0.1:PORT/0``."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server.url
    server.stop()


@pytest.fixture
def redis_process(tmp_path_factory):
    """Factory: ``redis_process()`` -> a RedisServer of this test alone (to stop, kill, restart)."""
    started: list[RedisServer] = []

    def start() -> RedisServer:
        started.append(RedisServer(tmp_path_factory.mktemp("redis")))
        return started[-1]

    yield start
    for server in started:
        server.kill()


class CeleryWorker:
    """`celery -A services.profiler.app worker --pool solo` (as compose and the stack run it) in its own
    process group, with a fixed hostname so a restart is the same worker coming back."""

    def __init__(self, redis_url: str, profiles: Path, queue: str, hostname: str, log_path: Path,
                 pool: str = "solo", node: str | None = None):
        hostname = hostname.replace("%h", socket.gethostname())
        self.redis_url, self.profiles, self.queue, self.hostname = redis_url, profiles, queue, hostname
        self.env = dict(os.environ, TANDEM_REDIS_URL=redis_url, TANDEM_PROFILES_DIR=str(profiles),
                        TANDEM_PROFILER_QUEUE=queue, TANDEM_WORKER_METRICS_PORT="0", PYTHONPATH=str(ROOT),
                        PYTHONUNBUFFERED="1", TANDEM_NODE_NAME=node or f"node-of-{queue}")
        self.cmd = [sys.executable, "-m", "celery", "-A", "services.profiler.app", "worker", "--loglevel", "INFO",
                    "--pool", pool, "--concurrency", "1", "--without-gossip", "--without-mingle",
                    "--without-heartbeat", "-n", hostname]
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60) -> "CeleryWorker":
        from celery import Celery

        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        probe = Celery(broker=self.redis_url, backend=self.redis_url)
        deadline = time.monotonic() + timeout_s
        while not self._pong(probe):
            if self.proc.poll() is not None:
                raise RuntimeError(f"celery worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            assert time.monotonic() < deadline, f"celery worker did not answer ping in {timeout_s} s:\n{self.log_tail()}"
        return self

    def _pong(self, probe) -> bool:
        try:
            return bool(probe.control.ping(destination=[self.hostname], timeout=0.5))
        except Exception:  # noqa: BLE001 — a pooled connection to a redis restarted meanwhile: ask again
            time.sleep(0.2)
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL the worker and the benchmark it runs (the whole group: a container killed)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()


@pytest.fixture
def worker_process(tmp_path_factory):
    """Factory: ``worker_process(redis_url, profiles_dir)`` -> a started CeleryWorker on a queue and
    hostname of its own; stopped at teardown."""
    started: list[CeleryWorker] = []

    def start(redis_url: str, profiles: Path, pool: str = "solo") -> CeleryWorker:
        n = len(started)
        worker = CeleryWorker(redis_url, profiles, f"tandem.test-{os.getpid()}-{n}", f"test-{os.getpid()}-{n}@%h",
                              tmp_path_factory.mktemp("worker") / "worker.log", pool)
        started.append(worker.start())
        return worker

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def celery_worker(redis_server, tmp_path_factory):
    """A real `celery -A services.profiler.app worker` subprocess on ``redis_server``.
    Yields (env the worker runs with, its profiles dir, its host queue name); its node is
    env["TANDEM_NODE_NAME"]."""
    profiles = tmp_path_factory.mktemp("profiles")
    worker = CeleryWorker(redis_server, profiles, f"tandem.test-{os.getpid()}", f"test-{os.getpid()}@%h",
                          tmp_path_factory.mktemp("worker") / "worker.log", pool="prefork", node=f"test-node-{os.getpid()}")
    worker.start()
    yield worker.env, profiles, worker.queue
    worker.stop()

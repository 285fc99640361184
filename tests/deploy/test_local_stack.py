"""`make run`'s process manager (services/local_stack.py) with real redis-server and Prometheus:
a taken port is named, Ctrl-C stops every child, an engine killed with SIGKILL is restarted, a child
dying past --max-restarts stops the stack. The full topology
(engine, gateway, worker) runs in test_stack_e2e.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.deploy.net import free_ports

REPO = Path(__file__).resolve().parents[2]


def children_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if int(fields.get("PPid", "0").strip()) == pid:
            out.append(int(status.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except OSError:
        return False
    return state != "Z"


def start_stack(tmp_path: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "services.local_stack", "--runs-dir", str(tmp_path), *args],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def ensure_stopped(proc: subprocess.Popen) -> None:
    """On a failed test: SIGTERM lets the stack stop its services (SIGKILL would orphan them)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float = 60) -> str:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        if needle in line:
            return "".join(seen)
    raise AssertionError(f"no {needle!r} in the stack's output:\n{''.join(seen)}")


def test_taken_port_is_named(tmp_path):
    redis_port, prom_port = free_ports(2)
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", prom_port))
        blocker.listen()
        proc = start_stack(tmp_path, "--services", "redis,prometheus", "--redis-port", str(redis_port),
                           "--prometheus-port", str(prom_port))
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2, out
    assert f"port {prom_port} (prometheus) is taken" in out
    assert not list(tmp_path.glob("stack-*")), "nothing may start when a port is taken"


def test_ctrl_c_stops_every_service(tmp_path):
    redis_port, prom_port = free_ports(2)
    proc = start_stack(tmp_path, "--services", "redis,prometheus", "--redis-port", str(redis_port),
                       "--prometheus-port", str(prom_port), "--scrape-interval", "1s")
    try:
        wait_for_line(proc, "stack ready")
        kids = children_of(proc.pid)
        assert len(kids) == 2, kids
        (run_dir,) = tmp_path.glob("stack-*")
        assert {p.name for p in run_dir.glob("*.log")} == {"redis.log", "prometheus.log"}
        assert (run_dir / "prometheus" / "targets.json").exists()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 0, out
    assert not [k for k in kids if alive(k)], "services outlived the stack"
    for port in (redis_port, prom_port):
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free again


def test_a_dying_service_stops_the_stack(tmp_path):
    redis_port, prom_port = free_ports(2)
    proc = start_stack(tmp_path, "--services", "redis,prometheus", "--redis-port", str(redis_port),
                       "--prometheus-port", str(prom_port), "--max-restarts", "0")
    try:
        wait_for_line(proc, "stack ready")
        kids = children_of(proc.pid)
        redis_pid = next(k for k in kids if "redis" in Path(f"/proc/{k}/cmdline").read_text())
        os.kill(redis_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 1, out
    assert "redis exited" in out
    assert not [k for k in kids if alive(k)]


def test_a_killed_engine_is_restarted_and_served_again(tmp_path):
    """Issue 20 item 8: `kill -9` of the engine tore the whole stack down."""
    import httpx

    gateway_port, engine_port = free_ports(2)
    proc = start_stack(tmp_path, "--services", "engine,gateway", "--model", "demo", "--port", str(gateway_port),
                       "--engine-port", str(engine_port), "--max-seq-len", "256")
    url = f"http://127.0.0.1:{gateway_port}/v1/completions"
    body = {"model": "tandem-demo", "prompt": "hi", "max_tokens": 2}
    try:
        wait_for_line(proc, "stack ready", timeout=300)
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        engine_pid = next(k for k in children_of(proc.pid) if "engine" in Path(f"/proc/{k}/cmdline").read_text())
        os.kill(engine_pid, signal.SIGKILL)
        wait_for_line(proc, "engine ready again", timeout=300)
        assert proc.poll() is None  # the stack kept running
        deadline = time.monotonic() + 60
        while (r := httpx.post(url, json=body, timeout=60)).status_code != 200:  # the gateway takes it back
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        ensure_stopped(proc)
    assert proc.returncode == 0, out

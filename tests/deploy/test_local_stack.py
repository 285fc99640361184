"""`make run`'s process manager (services/local_stack.py) with real redis-server and Prometheus:
a taken port is named, Ctrl-C stops every child, an engine killed with SIGKILL is restarted, a child
dying past --max-restarts stops the stack; `--engines N` runs N engines behind the gateway (two CPU
engines here; one per GPU on a GPU host, the `gpu` test). The full topology (engine, gateway, worker)
runs in test_stack_e2e.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deploy.net import free_port_run, free_ports

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


def _cpus_allowed(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def test_two_cpu_engines_behind_one_gateway(tmp_path):
    """`tandem stack --engines 2` (issue 25): two CPU engines on their own ports and cores, one gateway
    whose requests land on both, Prometheus scraping both with distinct engine labels and the dashboard's
    per-engine panels drawing both; one engine killed, the other serves on."""
    import httpx

    from services.common.topology import parse_cpulist

    gateway_port, prom_port = free_ports(2)
    engine_port = free_port_run(2, exclude=(gateway_port, prom_port))  # + 1: the second engine
    proc = start_stack(tmp_path, "--services", "engine,gateway,prometheus", "--engines", "2", "--model", "demo",
                       "--port", str(gateway_port), "--engine-port", str(engine_port), "--prometheus-port",
                       str(prom_port), "--scrape-interval", "1s", "--max-seq-len", "256", "--moe-backend", "hybrid",
                       "--moe-cache-rate", "0.5")
    url = f"http://127.0.0.1:{gateway_port}/v1/completions"
    body = {"model": "tandem-demo", "prompt": "hi", "max_tokens": 2}
    try:
        wait_for_line(proc, "stack ready", timeout=300)
        engine_urls = [f"http://127.0.0.1:{engine_port + i}" for i in range(2)]
        for _ in range(4):  # one at a time: the ties between idle engines take turns
            assert httpx.post(url, json=body, timeout=60).status_code == 200
        finished = [httpx.get(u + "/engine/v1/stats", timeout=10).json()["requests_finished"] for u in engine_urls]
        assert finished == [2, 2], finished

        engines = {}
        for kid in children_of(proc.pid):
            cmdline = Path(f"/proc/{kid}/cmdline").read_text().split("\0")
            if "engine" in cmdline:
                engines[int(cmdline[cmdline.index("--port") + 1])] = kid
        assert sorted(engines) == [engine_port, engine_port + 1]
        allowed = [parse_cpulist(_cpus_allowed(engines[p])) for p in sorted(engines)]
        every = sorted(os.sched_getaffinity(0))
        if len(every) > 1:  # one share of the cores each, together all of them
            assert not set(allowed[0]) & set(allowed[1]) and sorted(allowed[0] + allowed[1]) == every, allowed

        deadline = time.monotonic() + 60
        while True:
            ups = httpx.get(f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": 'up{job="engine"}'},
                            timeout=10).json()["data"]["result"]
            labels = sorted((u["metric"]["engine"], u["metric"]["gpu"], u["value"][1]) for u in ups)
            if labels == [("0", "cpu", "1"), ("1", "cpu", "1")]:
                break
            assert time.monotonic() < deadline, ups
            time.sleep(0.5)

        # the dashboard's Engines row: every panel draws one series per engine
        from tests.deploy.promql import dashboard_panels

        row = [p for p in dashboard_panels() if p["title"].endswith("per engine")]
        assert len(row) == 6
        exprs = [t["expr"].replace("$__rate_interval", "1m").replace("$model_name", ".*") for p in row
                 for t in p["targets"]]
        deadline = time.monotonic() + 30
        while True:
            per_expr = {e: sorted(r["metric"].get("engine", "") for r in httpx.get(
                f"http://127.0.0.1:{prom_port}/api/v1/query", params={"query": e}, timeout=10).json()["data"]["result"])
                for e in exprs}
            if all(engines_seen == ["0", "1"] for engines_seen in per_expr.values()):
                break
            assert time.monotonic() < deadline, {e: seen for e, seen in per_expr.items() if seen != ["0", "1"]}
            time.sleep(0.5)

        os.kill(engines[engine_port], signal.SIGKILL)  # the stack restarts it; until then engine 1 serves
        for _ in range(3):  # routed to the dead one, a request fails over to the live one
            assert httpx.post(url, json=body, timeout=60).status_code == 200
    finally:
        ensure_stopped(proc)


def test_engine_placements_one_per_gpu(monkeypatch):
    """--device cuda --engines 0: one engine per visible GPU, each seeing only its GPU (by UUID, which
    CUDA_VISIBLE_DEVICES accepts and which survives renumbering) and labelled with it; a count over the
    GPUs, or several engines on one pinned device, is refused naming the problem."""

    from services import local_stack
    from services.common.topology import Gpu

    gpus = [Gpu(i, f"GPU-{i}", f"0000:{i:02x}:00.0") for i in range(3)]
    monkeypatch.setattr(local_stack, "list_gpus", lambda: gpus)
    monkeypatch.setattr(local_stack, "engine_cpusets", lambda gs: [[2 * g.index, 2 * g.index + 1] for g in gs])
    config = local_stack.StackConfig(model="demo", device="cuda", engines=0, engine_port=9000)
    placed = local_stack.engine_placements(config, {})
    assert [(p.name, p.port, p.cpus, p.env, p.labels) for p in placed] == [
        (f"engine{'-%d' % i if i else ''}", 9000 + i, [2 * i, 2 * i + 1], {"CUDA_VISIBLE_DEVICES": f"GPU-{i}"},
         {"engine": str(i), "gpu": f"GPU-{i}"}) for i in range(3)]
    visible = local_stack.engine_placements(config, {"CUDA_VISIBLE_DEVICES": "2,GPU-0"})
    assert [p.labels["gpu"] for p in visible] == ["GPU-2", "GPU-0"]
    single = local_stack.engine_placements(local_stack.StackConfig(model="demo", device="cuda"), {})
    assert [(p.cpus, p.env, p.labels) for p in single] == [([], {}, {"engine": "0", "gpu": "GPU-0"})]
    for device, n, why in (("cuda", 4, "only 3 GPU"), ("cuda:1", 2, "use --device cuda"),
                           ("cpu", 0, "needs --device cuda"), ("cpu", -1, "must be 0")):
        with pytest.raises(ValueError, match=why):
            local_stack.engine_placements(local_stack.StackConfig(model="demo", device=device, engines=n), {})


def test_stack_help_explains_engines():
    out = subprocess.run([sys.executable, "-m", "services.local_stack", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    assert "--engines ENGINES" in out and "one per visible GPU" in " ".join(out.split())


@pytest.mark.gpu
def test_one_engine_per_gpu_on_cuda(tmp_path):
    """`tandem stack --device cuda --engines 0` on a GPU host: one engine per GPU, each one's process on
    its own GPU (nvidia-smi's compute apps, read independently of the stack) and on CPUs of that GPU's
    NUMA node (sysfs local_cpulist), all serving through the one gateway."""
    import httpx
    import torch

    from services.common.topology import gpu_local_cpus, parse_cpulist
    from services.local_stack import visible_gpus

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    gpus = visible_gpus(dict(os.environ))
    assert gpus, "torch sees a GPU but nvidia-smi lists none"
    gateway_port, = free_ports(1)
    engine_port = free_port_run(len(gpus), exclude=(gateway_port,))
    proc = start_stack(tmp_path, "--services", "engine,gateway", "--device", "cuda", "--engines", "0", "--model",
                       "demo", "--port", str(gateway_port), "--engine-port", str(engine_port), "--max-seq-len", "256",
                       "--moe-backend", "hybrid")
    url = f"http://127.0.0.1:{gateway_port}/v1/completions"
    try:
        wait_for_line(proc, "stack ready", timeout=600)
        for _ in range(2 * len(gpus)):
            resp = httpx.post(url, json={"model": "tandem-demo", "prompt": "hi", "max_tokens": 2}, timeout=120)
            assert resp.status_code == 200, resp.text
        finished = [httpx.get(f"http://127.0.0.1:{engine_port + i}/engine/v1/stats", timeout=10).json()
                    ["requests_finished"] for i in range(len(gpus))]
        assert finished == [2] * len(gpus), finished
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True, timeout=60).stdout
        gpu_of_pid = {int(pid): uuid.strip() for pid, uuid in (line.split(",") for line in apps.splitlines() if line)}
        engines = {}
        for kid in children_of(proc.pid):
            cmdline = Path(f"/proc/{kid}/cmdline").read_text().split("\0")
            if "engine" in cmdline:
                engines[int(cmdline[cmdline.index("--port") + 1]) - engine_port] = kid
        assert sorted(engines) == list(range(len(gpus)))
        for i, gpu in enumerate(gpus):
            assert gpu_of_pid.get(engines[i]) == gpu.uuid, (i, gpu, gpu_of_pid)
            allowed = parse_cpulist(_cpus_allowed(engines[i]))
            local = set(gpu_local_cpus(gpu.bus_id)) & os.sched_getaffinity(0)
            if len(gpus) > 1 and local:  # else: not pinned (one engine), or sysfs gives no list here
                assert set(allowed) <= local, (gpu, allowed, local)
    finally:
        ensure_stopped(proc)

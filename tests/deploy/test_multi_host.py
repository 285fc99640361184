"""Several hosts, for real, on one machine: two "GPU hosts" and a control host as network namespaces
(tests/deploy/netns.py), each GPU host with a CPU engine (the demo model) and a profiler worker on its
node's queue, a real Redis and one gateway on the control host that finds both engines by one DNS name
(its /etc/hosts, as the cluster DNS lists a headless Service's pods). Requests spread over both; one
host's engine is killed and requests keep succeeding on the other; the name's answer changes and the
gateway follows; a profile job for host B runs on B's worker only, and its profile is listed under B.

Needs root and iproute2 (CI runs as root); a namespace that cannot be created fails the test, loudly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.deploy.netns import Lan

ROOT = Path(__file__).resolve().parents[2]
NAME = "engines.tandem.test"  # the DNS name the gateway is given (a headless Service's, on Kubernetes)
ADMIN = "admin-multi-host"
ENGINE_TOKEN = "engine-multi-host"  # the engines listen beyond loopback: their API needs the token
REDIS_PORT, ENGINE_PORT, GATEWAY_PORT = 6379, 8001, 8000  # each namespace has its own ports
FAST_BW = {"kind": "bw", "model": "tiny", "seconds": 0.05, "buffer_mib": 4, "cpu_kernel": "torch"}


def wait_for(what: str, check, timeout_s: float, processes=()) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        for p in processes:
            assert p.alive(), f"{p.log_path.name} exited while waiting for {what}:\n{p.log_tail()}"
        try:
            value = check()
            if value:
                return value
        except (httpx.HTTPError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.log_path.name}\n{p.log_tail(1500)}" for p in processes)
            raise AssertionError(f"{what}: not after {timeout_s} s\n{tails}")
        time.sleep(0.3)


def fetch_in(lan: Lan, host: str, url: str) -> dict:
    """GET ``url`` from inside ``host``'s namespace (the test's own namespace reaches only the control host)."""
    code = ("import os, sys, urllib.request as u; token = os.environ['TANDEM_ENGINE_TOKEN'];"
            "r = u.Request(sys.argv[1], headers={'Authorization': 'Bearer ' + token});"
            "print(u.urlopen(r, timeout=10).read().decode())")
    out = subprocess.run(["ip", "netns", "exec", lan.ns[host], sys.executable, "-c", code, url],  # the token in env
                         capture_output=True, text=True, timeout=30, env={**os.environ, "TANDEM_ENGINE_TOKEN": ENGINE_TOKEN})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def finished(lan: Lan, host: str) -> int:
    return fetch_in(lan, host, f"http://{lan.address(host)}:{ENGINE_PORT}/engine/v1/stats")["requests_finished"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, service_env):
    assert os.geteuid() == 0, "this test builds network namespaces: it must run as root (CI does)"
    tmp = tmp_path_factory.mktemp("multi-host")
    # the demo checkpoint written once, before two engines would write it at the same time
    subprocess.run([sys.executable, "-c", "from services.engine.models.demo import ensure_demo_checkpoint as e; e()"],
                   env=service_env, cwd=ROOT, check=True, timeout=300)
    lan = Lan(f"td{os.getpid() % 100000}", ["host-a", "host-b"])
    try:
        env = {**service_env, "TANDEM_ENGINE_TOKEN": ENGINE_TOKEN, "PYTHONPATH": str(ROOT)}
        redis = lan.run("ctl", ["redis-server", "--port", str(REDIS_PORT), "--bind", "0.0.0.0", "--protected-mode",
                                "no", "--save", "", "--appendonly", "no", "--dir", str(tmp)], env, tmp / "redis.log", ROOT)
        engines, workers, profiles = {}, {}, {}
        for host in lan.hosts:
            profiles[host] = tmp / f"profiles-{host}"
            profiles[host].mkdir()
            engines[host] = lan.run(host, [sys.executable, "-m", "services.cli", "engine", "--model", "demo",
                                           "--device", "cpu", "--max-seq-len", "128", "--host", "0.0.0.0",
                                           "--port", str(ENGINE_PORT)], env, tmp / f"engine-{host}.log", ROOT)
            workers[host] = lan.run(host, [sys.executable, "-m", "celery", "-A", "services.profiler.app", "worker",
                                           "--pool", "solo", "--loglevel", "INFO", "--without-gossip", "--without-mingle",
                                           "--without-heartbeat", "--hostname", f"tandem-worker@{host}"],
                                    {**env, "TANDEM_NODE_NAME": host, "TANDEM_PROFILES_DIR": str(profiles[host]),
                                     "TANDEM_REDIS_URL": f"redis://{lan.ctl_address_for(host)}:{REDIS_PORT}/0",
                                     "TANDEM_WORKER_METRICS_PORT": "0"}, tmp / f"worker-{host}.log", ROOT)
        lan.set_hosts("ctl", {NAME: [lan.address(h) for h in lan.hosts]})
        gateway = lan.run("ctl", [sys.executable, "-m", "services.cli", "gateway", "--host", "0.0.0.0", "--port",
                                  str(GATEWAY_PORT), "--engines-dns", f"http://{NAME}:{ENGINE_PORT}",
                                  "--engines-dns-refresh-s", "0.5", "--health-interval-s", "0.5",
                                  "--redis-url", f"redis://127.0.0.1:{REDIS_PORT}/0", "--admin-token", ADMIN],
                          env, tmp / "gateway.log", ROOT)
        url = f"http://{lan.address('ctl')}:{GATEWAY_PORT}"
        everything = [redis, gateway, *engines.values(), *workers.values()]

        def both_healthy():
            data = httpx.get(url + "/admin/engines", headers=auth(), timeout=5).json()["data"]
            return sorted(e["id"] for e in data if e["healthy"]) == sorted(f"{lan.address(h)}:{ENGINE_PORT}"
                                                                           for h in lan.hosts)

        wait_for("both engines healthy behind the gateway", both_healthy, 240, everything)
        yield {"lan": lan, "url": url, "engines": engines, "workers": workers, "profiles": profiles}
    finally:
        lan.close()


def auth() -> dict:
    return {"Authorization": f"Bearer {ADMIN}"}


def complete(url: str, i: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tandem-demo", "prompt": f"hello {i}", "max_tokens": 2},
                      timeout=60)


def test_requests_spread_over_both_hosts_and_survive_one_host_dying(cluster):
    lan, url, engines = cluster["lan"], cluster["url"], cluster["engines"]
    before = {h: finished(lan, h) for h in lan.hosts}
    for i in range(6):  # one at a time: ties go round robin, so both hosts serve
        r = complete(url, i)
        assert r.status_code == 200, r.text
    served = {h: finished(lan, h) - before[h] for h in lan.hosts}
    assert sum(served.values()) == 6 and all(n >= 2 for n in served.values()), served

    engines["host-a"].kill()  # host A's engine dies; its address stays in DNS, as a dead pod's would briefly
    b_before = finished(lan, "host-b")
    for i in range(6):
        r = complete(url, 100 + i)
        assert r.status_code == 200, f"request {i} after host A died: {r.status_code} {r.text}"
    assert finished(lan, "host-b") - b_before == 6
    health = {e["id"]: e["healthy"] for e in httpx.get(url + "/admin/engines", headers=auth(), timeout=5).json()["data"]}
    assert health == {f"{lan.address('host-a')}:{ENGINE_PORT}": False, f"{lan.address('host-b')}:{ENGINE_PORT}": True}

    lan.set_hosts("ctl", {NAME: [lan.address("host-b")]})  # the name drops host A (its pod is gone)
    wait_for("host A retired from the pool", lambda: [e["id"] for e in httpx.get(
        url + "/admin/engines", headers=auth(), timeout=5).json()["data"]] == [f"{lan.address('host-b')}:{ENGINE_PORT}"],
        10)
    assert complete(url, 200).status_code == 200


def test_a_profile_job_for_host_b_runs_on_b_only(cluster):
    lan, url, profiles = cluster["lan"], cluster["url"], cluster["profiles"]
    r = httpx.post(url + "/admin/profiles", json={**FAST_BW, "node": "host-b"}, headers=auth(), timeout=30)
    assert r.status_code == 202, r.text
    assert r.json()["queue"] == "tandem.profiler.host-b"

    def ended():
        job = httpx.get(f"{url}/admin/jobs/{r.json()['id']}", headers=auth(), timeout=5).json()
        return job if job["state"] in ("SUCCESS", "FAILURE") else None

    job = wait_for("the profile job to end", ended, 180, cluster["workers"].values())
    assert job["state"] == "SUCCESS", job
    assert job["node"] == "host-b" and job["worker"] == "tandem-worker@host-b"
    written = Path(job["result"]["profile_path"])
    assert written.parent == profiles["host-b"] and written.exists()
    assert not list(profiles["host-a"].glob("*.json")), "host A's worker must not have run it"
    listed = httpx.get(url + "/admin/profiles", headers=auth(), timeout=5).json()["nodes"]
    assert [p["file"] for p in listed["host-b"]["data"]] == [written.name]
    assert listed["host-a"]["data"] == []  # host A reported its (empty) profiles dir when its worker started
    one = httpx.get(url + "/admin/profiles", params={"node": "host-b"}, headers=auth(), timeout=5).json()
    assert one["data"][0]["valid"] and one["data"][0]["profile"]["gpu"]["uuid"] == job["result"]["gpu_uuid"]

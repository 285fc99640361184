"""The admin API end to end: `tandem gateway` -> real redis-server -> real Celery worker
(`celery -A services.profiler.app worker`) running `tandem bench bw`; profiles listed; engine reload."""

from __future__ import annotations

import time

import httpx
import pytest

ADMIN = "admin-secret"
API_KEY = "sk-user"
FAST = {"model": "tiny", "seconds": 0.05, "buffer_mib": 4}  # a seconds-long bench bw


@pytest.fixture(scope="module")
def admin_stack(engine_process, gateway_process, redis_server, celery_worker):
    _, profiles, queue = celery_worker
    engine = engine_process("--model", "demo", "--max-seq-len", "128")
    gateway = gateway_process("--engine", engine.url, "--api-key", API_KEY, "--admin-token", ADMIN,
                              "--redis-url", redis_server, "--profiles-dir", str(profiles))
    return gateway, profiles, queue


def _admin(gateway, method: str, path: str, token: str | None = ADMIN, headers: dict | None = None,
           **kw) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})}
    return httpx.request(method, gateway.url + path, headers=headers, timeout=30, **kw)


def _wait_job(gateway, job_id: str, timeout_s: float = 240) -> tuple[dict, set[str]]:
    states, deadline = set(), time.monotonic() + timeout_s
    while True:
        r = _admin(gateway, "GET", f"/admin/jobs/{job_id}")
        assert r.status_code == 200, r.text
        job = r.json()
        states.add(job["state"])
        if job["state"] in ("SUCCESS", "FAILURE"):
            return job, states
        assert time.monotonic() < deadline, f"job {job_id} still {job['state']} after {timeout_s} s"
        time.sleep(0.1)


def test_profile_job_runs_on_the_worker_and_the_profile_is_listed(admin_stack):
    gateway, profiles, queue = admin_stack
    r = _admin(gateway, "POST", "/admin/profiles", json={"kind": "bw", **FAST, "queue": queue})
    assert r.status_code == 202, r.text
    job, states = _wait_job(gateway, r.json()["id"])
    assert job["state"] == "SUCCESS", job
    assert states <= {"PENDING", "STARTED", "PROGRESS", "SUCCESS"}
    assert job["attempts"] == 1 and job["request"]["seconds"] == 0.05
    path = job["result"]["profile_path"]
    assert path.startswith(str(profiles))
    listed = _admin(gateway, "GET", "/admin/profiles").json()["data"]
    assert [p["path"] for p in listed if p["valid"]] == [path]
    assert listed[0]["profile"]["gpu"]["uuid"] == job["result"]["gpu_uuid"]


def test_job_for_a_node_runs_on_that_nodes_worker_and_its_profiles_are_listed(admin_stack, celery_worker):
    """A job names a node: it goes to that node's queue, its worker measures, and that worker's report of its
    profiles dir is listed under the node (the gateway need not see the node's disk)."""
    gateway, profiles, _ = admin_stack
    node = celery_worker[0]["TANDEM_NODE_NAME"]
    r = _admin(gateway, "POST", "/admin/profiles", json={"kind": "bw", **FAST, "node": node})
    assert r.status_code == 202, r.text
    assert r.json()["queue"] == f"tandem.profiler.{node}" and r.json()["node"] == node
    job, _ = _wait_job(gateway, r.json()["id"])
    assert job["state"] == "SUCCESS" and job["node"] == node, job
    listed = _admin(gateway, "GET", "/admin/profiles").json()
    assert job["result"]["profile_path"] in [p["path"] for p in listed["nodes"][node]["data"]]
    one = _admin(gateway, "GET", "/admin/profiles", params={"node": node})
    assert one.status_code == 200 and one.json()["node"] == node
    assert [p["file"] for p in one.json()["data"]] == sorted(p.name for p in profiles.glob("*.json"))
    missing = _admin(gateway, "GET", "/admin/profiles", params={"node": "no-such-node"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "node"
    assert node in missing.json()["error"]["message"]


def test_failing_job_reports_its_error(admin_stack):
    gateway, _, queue = admin_stack
    r = _admin(gateway, "POST", "/admin/profiles", json={**FAST, "model": "no-such-preset", "queue": queue})
    job, _ = _wait_job(gateway, r.json()["id"])
    assert job["state"] == "FAILURE" and "no-such-preset" in job["error"] and job["result"] is None


def test_unknown_job_is_404(admin_stack):
    gateway, _, _ = admin_stack
    r = _admin(gateway, "GET", "/admin/jobs/3f2a7c1e-0000-4000-8000-000000000000")
    assert r.status_code == 404 and r.json()["error"]["param"] == "job_id"


@pytest.mark.parametrize("body, param", [
    ({"argv": ["-o", "/etc/passwd"]}, "argv"),  # raw CLI flags: could write anywhere
    ({"kind": "bw", "output": "/tmp/x.json"}, "output"),
    ({"kind": "bw", "profiles_dir": "/tmp"}, "profiles_dir"),
    ({"kind": "load", "model": "/models/m", "json": "/tmp/x.json"}, "json"),
    ({"kind": "load", "model": "/models/m", "bank_dir": "/tmp"}, "bank_dir"),
    ({"kind": "load", "model": "relative/dir"}, "model"),
    ({"kind": "bw", "model": "--output=/tmp/x"}, "model"),
    ({"kind": "bw", "seconds": 0}, "seconds"),
    ({"kind": "bw", "dtype": ["int3"]}, "dtype"),
    ({"kind": "bw", "node": "../etc"}, "node"),
    ({"kind": "bw", "node": 7}, "node"),
    ({"kind": "bw", "node": "gpu-a", "queue": "tandem.profiler.gpu-b"}, "queue"),  # which one?
])
def test_job_requests_are_typed_and_write_nowhere_else(admin_stack, body, param):
    """Admin jobs take typed fields only; no field names an output path (outputs stay in the
    worker's profiles dir), and nothing is queued for a refused body."""
    gateway, _, _ = admin_stack
    r = _admin(gateway, "POST", "/admin/profiles", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_admin_auth_and_validation(admin_stack):
    gateway, _, _ = admin_stack
    assert _admin(gateway, "GET", "/admin/profiles", token=None).status_code == 401
    r = _admin(gateway, "GET", "/admin/profiles", token=API_KEY)  # an API key is not the admin token
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token"
    r = _admin(gateway, "POST", "/admin/profiles", json={"kind": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kind"
    r = _admin(gateway, "POST", "/admin/profiles", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"]
    # and the admin token is not an API key
    r = httpx.get(gateway.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert r.status_code == 401


def test_engine_reload_profile(admin_stack):
    gateway, _, _ = admin_stack
    engines = _admin(gateway, "GET", "/admin/engines").json()["data"]
    assert engines[0]["healthy"] and engines[0]["model_id"] == "tandem-demo"
    r = _admin(gateway, "POST", f"/admin/engines/{engines[0]['id']}/reload-profile")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["engine"] == engines[0]["id"] and body["backend"] == "resident" and body["reloaded"] is False
    assert _admin(gateway, "POST", "/admin/engines/99/reload-profile").status_code == 404
    every = _admin(gateway, "POST", "/admin/engines/all/reload-profile")  # one engine per GPU: all at once
    assert every.status_code == 200, every.text
    assert [(d["engine"], d["backend"]) for d in every.json()["data"]] == [(engines[0]["id"], "resident")]


def test_reload_every_engine_reports_each_one(admin_stack, gateway_process, redis_server):
    """id "all" with one engine of two down: the live one reloads, the dead one's entry carries its 503."""
    gateway, profiles, _ = admin_stack
    live = _admin(gateway, "GET", "/admin/engines").json()["data"][0]["url"]
    two = gateway_process("--engine", f"{live},http://127.0.0.1:9", "--admin-token", ADMIN, "--redis-url",
                          redis_server, "--profiles-dir", str(profiles))
    r = _admin(two, "POST", "/admin/engines/all/reload-profile")
    assert r.status_code == 200, r.text
    ok, down = r.json()["data"]
    assert (ok["engine"], ok["backend"]) == ("0", "resident")
    assert (down["engine"], down["status"], down["error"]["type"]) == ("1", 503, "service_unavailable")


def test_admin_disabled_without_token(gateway_process, engine_process):
    gateway = gateway_process("--engine", "http://127.0.0.1:9", wait=False)
    deadline = time.monotonic() + 30
    while True:
        try:
            r = httpx.get(gateway.url + "/admin/profiles", headers={"Authorization": "Bearer x"}, timeout=5)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
    assert r.status_code == 403 and "--admin-token" in r.json()["error"]["message"]

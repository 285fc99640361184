"""The profiler worker end to end: a real redis-server, a real `celery -A services.profiler.app worker`
process, tasks submitted through the broker; the profile lands in the worker's profiles dir."""

from __future__ import annotations

import os
import time

import pytest

from services.common import profiles as P
from services.profiler.app import SHARED_QUEUE

FAST = ["--model", "tiny", "--seconds", "0.05", "--buffer-mib", "4", "--cpu-kernel", "torch"]


@pytest.fixture
def client(celery_worker):
    """A Celery client app on the test broker (the app module reads TANDEM_REDIS_URL at import, so
    build a client from the same config instead of importing it with the wrong env)."""
    from celery import Celery

    env, profiles, queue = celery_worker
    app = Celery(broker=env["TANDEM_REDIS_URL"], backend=env["TANDEM_REDIS_URL"])
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    return app, profiles, queue


def _wait(result, timeout: float = 240):
    states, deadline = set(), time.monotonic() + timeout
    while not result.ready():
        states.add(result.state)
        assert time.monotonic() < deadline, f"task {result.id} still {result.state} after {timeout} s"
        time.sleep(0.05)
    return states


def test_bench_bw_task_writes_the_profile(client):
    app, profiles, queue = client
    r = app.send_task("tandem.bench_bw", args=[FAST], queue=queue)  # this host's queue
    states = _wait(r)
    assert r.state == "SUCCESS", r.result
    out = r.result
    path = profiles / P.profile_filename(out["gpu_uuid"])
    assert out["profile_path"] == str(path) and path.exists()
    profile = P.read_profile(path)
    assert out["summary"]["ceilings"]["cpu_read"] == pytest.approx(profile.ceilings.cpu_read)
    assert "profile written" in out["output"]
    assert not states - {"PENDING", "STARTED", "PROGRESS"}
    assert [e.path for e in P.list_profiles(profiles) if e.profile is not None] == [path]


def test_failing_task_reports_its_message_and_leaves_no_file(client, tmp_path):
    app, _, queue = client
    target = tmp_path / "profiles"
    r = app.send_task("tandem.bench_bw", args=[[*FAST, "--profiles-dir", str(target), "--dtype", "int3"]],
                      queue=queue)
    _wait(r)
    assert r.state == "FAILURE"
    assert isinstance(r.result, Exception)
    message = str(r.result)
    assert "exited 2" in message and "--dtype" in message and "int3" in message
    assert not target.exists() or os.listdir(target) == []


def test_non_list_argument_fails_cleanly(client):
    app, _, queue = client
    r = app.send_task("tandem.bench_bw", args=["--model tiny"], queue=queue)
    _wait(r)
    assert r.state == "FAILURE" and "list of CLI flags" in str(r.result)


def test_worker_survives_and_serves_the_shared_queue(client):
    app, profiles, _ = client
    r = app.send_task("tandem.bench_bw", args=[[*FAST, "--dtype", "float32"]], queue=SHARED_QUEUE)
    _wait(r, timeout=120)
    assert r.state == "SUCCESS", r.result
    assert "float32" in r.result["summary"]["kernels"]


def test_bench_load_task(client, moe_checkpoint, tmp_path):
    app, _, queue = client
    r = app.send_task("tandem.bench_load", args=[["--model", str(moe_checkpoint), "--modes", "parallel",
                                                   "--bank-dir", str(tmp_path / "banks")]], queue=queue)
    _wait(r)
    assert r.state == "SUCCESS", r.result
    assert r.result["ok"] is True
    assert [row["mode"] for row in r.result["rows"]] == ["serial", "parallel"]
    assert all(row["status"] == "ok" for row in r.result["rows"])

"""The profiler worker end to end: a real redis-server, a real `celery -A services.profiler.app worker`
process, typed job requests submitted through the broker; the profile lands in the worker's profiles dir."""

from __future__ import annotations

import os
import time

import pytest

from services.common import profiles as P
from services.common.jobs import SHARED_QUEUE, BenchBwRequest, BenchLoadRequest, JobStore, send_job

FAST = BenchBwRequest(model="tiny", seconds=0.05, buffer_mib=4, cpu_kernel="torch")


@pytest.fixture
def client(celery_worker):
    """A Celery client app on the test broker (the app module reads TANDEM_REDIS_URL at import, so
    build a client from the same config instead of importing it with the wrong env)."""
    from celery import Celery

    env, profiles, queue = celery_worker
    app = Celery(broker=env["TANDEM_REDIS_URL"], backend=env["TANDEM_REDIS_URL"])
    app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    store = JobStore(env["TANDEM_REDIS_URL"])
    return lambda request, queue: app.AsyncResult(send_job(app, store, request, queue)), app, profiles, queue


def _wait(result, timeout: float = 240):
    states, deadline = set(), time.monotonic() + timeout
    while not result.ready():
        states.add(result.state)
        assert time.monotonic() < deadline, f"task {result.id} still {result.state} after {timeout} s"
        time.sleep(0.05)
    return states


def test_bench_bw_task_writes_the_profile(client):
    send, _, profiles, queue = client
    r = send(FAST, queue)  # this host's queue
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


def test_failing_task_reports_its_message_and_leaves_no_file(client):
    send, _, profiles, queue = client
    before = sorted(os.listdir(profiles))
    r = send(FAST.model_copy(update={"model": "no-such-preset"}), queue)
    _wait(r)
    assert r.state == "FAILURE"
    assert isinstance(r.result, Exception)
    message = str(r.result)
    assert "exited 2" in message and "no-such-preset" in message
    assert sorted(os.listdir(profiles)) == before


@pytest.mark.parametrize("args, kwargs", [
    ([["-o", "/tmp/overwritten.json"]], {}),  # the old raw argv
    ([], {"request": {"output": "/tmp/overwritten.json"}}),
    ([], {"request": {"model": "-otiny"}}),
])
def test_raw_flags_and_unknown_fields_are_refused_by_the_worker(client, args, kwargs):
    """The queue is an input too: a message that is not a valid typed request fails, nothing runs."""
    _, app, _, queue = client
    r = app.send_task("tandem.bench_bw", args=args, kwargs=kwargs, queue=queue)
    _wait(r)
    assert r.state == "FAILURE" and "BenchFailed" in type(r.result).__name__ + repr(r.result)
    assert not os.path.exists("/tmp/overwritten.json")


def test_worker_survives_and_serves_the_shared_queue(client):
    send, _, _, _ = client
    r = send(FAST.model_copy(update={"dtype": ["float32"]}), SHARED_QUEUE)
    _wait(r, timeout=120)
    assert r.state == "SUCCESS", r.result
    assert "float32" in r.result["summary"]["kernels"]


def test_bench_load_task(client, moe_checkpoint):
    send, _, profiles, queue = client
    r = send(BenchLoadRequest(model=str(moe_checkpoint), modes=["parallel", "repacked"]), queue)
    _wait(r)
    assert r.state == "SUCCESS", r.result
    assert r.result["ok"] is True
    assert [row["mode"] for row in r.result["rows"]] == ["serial", "parallel", "convert (one-time)", "repacked"]
    assert all(row["status"] == "ok" for row in r.result["rows"])
    assert f"--bank-dir={profiles}/banks/ckpt" in r.result["command"]  # inside the profiles dir
    assert not (profiles / "banks" / "ckpt").exists()  # and removed after the run (no keep_bank)


def test_gpus_to_profile():
    from services.profiler.tasks import gpus_to_profile

    assert gpus_to_profile("all", lambda: ["GPU-a", "GPU-b"]) == ["GPU-a", "GPU-b"]
    assert gpus_to_profile("all", list) == [None]  # no GPU: the CPU-only profile
    assert gpus_to_profile("GPU-b", lambda: ["GPU-a", "GPU-b"]) == ["GPU-b"]
    assert gpus_to_profile(None, lambda: ["GPU-a"]) == [None]


def test_bench_bw_all_gpus_returns_one_profile_per_gpu(client):
    """{"gpu": "all"} on a host without a GPU: one benchmark, its CPU-only profile, in the list shape."""
    send, _, profiles, queue = client
    r = send(FAST.model_copy(update={"gpu": "all"}), queue)
    _wait(r)
    assert r.state == "SUCCESS", r.result
    (one,) = r.result["profiles"]
    assert r.result["gpu_uuids"] == [one["gpu_uuid"]] == [P.cpu_uuid()]
    assert one["profile_path"] == str(profiles / P.profile_filename(one["gpu_uuid"]))

"""Jobs are never lost nor misreported (docs/operating.md): real redis-servers started as the stack
starts them, real `celery worker --pool solo` processes killed with SIGKILL, Redis stopped mid-job."""

from __future__ import annotations

import time

import httpx
import pytest
from celery import Celery

from services.common import profiles as P
from services.common.jobs import MAX_ATTEMPTS, STALLED_AFTER_S, BenchBwRequest, JobStore, send_job

FAST = BenchBwRequest(model="tiny", seconds=0.05, buffer_mib=4, cpu_kernel="torch")
SLOW = FAST.model_copy(update={"seconds": 0.4})  # ~10 s of measurements: time to act mid-job


class Client:
    """What the gateway does: record + send a job; read its record and Celery's end state."""

    def __init__(self, redis_url: str):
        self.app = Celery(broker=redis_url, backend=redis_url)
        self.app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
        self.store = JobStore(redis_url)

    def send(self, request: BenchBwRequest, queue: str) -> str:
        return send_job(self.app, self.store, request, queue)

    def state(self, job_id: str) -> str:
        return self.app.AsyncResult(job_id).state

    def wait_end(self, job_id: str, timeout_s: float = 240):
        deadline = time.monotonic() + timeout_s
        result = self.app.AsyncResult(job_id)
        while not result.ready():
            assert time.monotonic() < deadline, f"job {job_id} not ended after {timeout_s} s: {self.store.get(job_id)}"
            time.sleep(0.1)
        return result

    def wait_progress(self, job_id: str, timeout_s: float = 120) -> dict:
        deadline = time.monotonic() + timeout_s
        while not (record := self.store.get(job_id)).get("progress"):
            assert time.monotonic() < deadline, f"job {job_id} shows no progress: {record}"
            time.sleep(0.05)
        return record


def test_queued_and_finished_jobs_survive_a_redis_restart(redis_process, worker_process, tmp_path):
    redis = redis_process()
    worker = worker_process(redis.url, tmp_path / "profiles")
    client = Client(redis.url)
    done = client.send(FAST, worker.queue)
    assert client.wait_end(done).state == "SUCCESS"
    worker.stop()
    queued = client.send(FAST, worker.queue)  # no worker consumes it now
    time.sleep(1.5)  # the append-only file is fsynced every second
    redis.kill()  # not even a clean shutdown
    redis.start()
    client = Client(redis.url)
    assert client.state(done) == "SUCCESS"
    assert client.store.get(queued)["attempts"] == 0  # still known, still queued
    worker.start()
    assert client.wait_end(queued).state == "SUCCESS"


def _admin_job(gateway, job_id: str) -> dict:
    deadline = time.monotonic() + 60
    while True:  # the gateway may still be starting
        try:
            r = httpx.get(f"{gateway.url}/admin/jobs/{job_id}", headers={"Authorization": "Bearer adm"}, timeout=10)
            assert r.status_code == 200, r.text
            return r.json()
        except httpx.TransportError:
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.3)


def test_worker_killed_mid_job_is_requeued_when_it_comes_back(redis_server, worker_process, gateway_process,
                                                              tmp_path):
    gateway = gateway_process("--engine", "http://127.0.0.1:9", "--admin-token", "adm", "--redis-url", redis_server,
                              wait=False)
    worker = worker_process(redis_server, tmp_path / "profiles")
    client = Client(redis_server)
    job = client.send(SLOW, worker.queue)
    assert client.wait_progress(job)["worker"] == worker.hostname
    assert _admin_job(gateway, job)["stalled"] is False
    worker.kill()  # kill -9: no chance to report anything
    assert client.state(job) == "PENDING"
    # the worker stays silent: after STALLED_AFTER_S the job view says so (the wait itself skipped)
    client.store.redis.hset("tandem:job:" + job, "heartbeat_at", time.time() - STALLED_AFTER_S - 1)
    view = _admin_job(gateway, job)
    assert view["state"] == "PROGRESS" and view["stalled"] is True and worker.hostname in view["error"]
    worker.start()
    result = client.wait_end(job)
    assert result.state == "SUCCESS", result.result
    assert client.store.get(job)["attempts"] == 2
    view = _admin_job(gateway, job)
    assert view["state"] == "SUCCESS" and view["stalled"] is False and view["attempts"] == 2
    assert (tmp_path / "profiles" / P.profile_filename(result.result["gpu_uuid"])).exists()
    assert not list((tmp_path / "profiles").glob(".tmp-*"))
    assert "requeued" in worker.log_tail(20000)


def test_a_job_that_keeps_killing_its_worker_fails_truthfully(redis_server, worker_process, tmp_path):
    worker = worker_process(redis_server, tmp_path / "profiles")
    client = Client(redis_server)
    job = client.send(SLOW, worker.queue)
    client.wait_progress(job)
    # as if this were already its last attempt (each attempt is one SIGKILL of the worker)
    client.store.redis.hset("tandem:job:" + job, "attempts", MAX_ATTEMPTS)
    worker.kill()
    worker.start()
    result = client.wait_end(job)
    assert result.state == "FAILURE"
    assert f"died {MAX_ATTEMPTS} times" in str(result.result)


def test_redis_stopping_mid_job_keeps_the_finished_benchmark(redis_process, worker_process, tmp_path):
    redis = redis_process()
    profiles = tmp_path / "profiles"
    worker = worker_process(redis.url, profiles)
    client = Client(redis.url)
    job = client.send(SLOW, worker.queue)
    client.wait_progress(job)
    redis.stop()
    deadline = time.monotonic() + 120
    while not list(profiles.glob("*.json")):  # the benchmark goes on and writes its profile
        assert worker.proc.poll() is None, worker.log_tail()
        assert time.monotonic() < deadline, f"no profile written while Redis was down:\n{worker.log_tail()}"
        time.sleep(0.2)
    time.sleep(1)
    assert not list(profiles.glob(".tmp-*"))
    redis.start()
    client = Client(redis.url)
    result = client.wait_end(job)
    assert result.state == "SUCCESS", result.result
    assert result.result["profile_path"] == str(next(profiles.glob("*.json")))


@pytest.mark.parametrize("state", ["SUCCESS", "FAILURE"])
def test_a_duplicate_delivery_of_an_ended_job_changes_nothing(redis_server, worker_process, tmp_path, state):
    """A job's message can come twice (its worker died after storing the result, before the ack):
    the second delivery leaves the stored end state alone and runs nothing."""
    worker = worker_process(redis_server, tmp_path / "profiles")
    client = Client(redis_server)
    request = FAST if state == "SUCCESS" else FAST.model_copy(update={"model": "no-such-preset"})
    job = client.send(request, worker.queue)
    assert client.wait_end(job).state == state
    client.app.send_task("tandem.bench_bw", kwargs={"request": request.model_dump(mode="json")},
                         queue=worker.queue, task_id=job)
    deadline = time.monotonic() + 60
    while "already ended" not in worker.log_tail(20000):
        assert time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.2)
    assert client.state(job) == state and client.store.get(job)["attempts"] == 1

"""Profiler jobs, torch-free: the typed requests clients send, and each job's record in Redis.

A job is asked for with a typed request (``BenchBwRequest`` / ``BenchLoadRequest``), never with raw
CLI flags: the worker builds the `tandem bench bw|load` command line itself from the validated fields
and chooses every output path (inside its profiles directory), so a client cannot make the worker
write anywhere else.

Job record (``JobStore``; Redis hash ``tandem:job:<id>``, expiring with the Celery result):

    kind, queue, request (JSON), submitted_at    written by the submitter before the task is sent
    node                                         the node the job was sent to (absent: a queue was named)
    worker, attempts, started_at                 written by the worker each time it starts the job
    heartbeat_at                                 refreshed by the worker every HEARTBEAT_S while it runs
    progress (JSON)                              the benchmark's latest progress line, best effort

Celery's own result holds only the end state (SUCCESS / FAILURE); whether a job was ever submitted,
and whether it is running, comes from this record. A job id without a record is unknown (HTTP 404).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.common.profiles import DEFAULT_THRESHOLD

BENCH_BW_TASK = "tandem.bench_bw"
BENCH_LOAD_TASK = "tandem.bench_load"
SHARED_QUEUE = "tandem.profiler"  # every worker consumes it (single-host setups: "any GPU host")
# A node (host) name as Kubernetes gives it (RFC 1123 subdomain, any case: a bare host's own hostname).
NODE_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$"
JOB_TTL_S = 7 * 24 * 3600  # records and Celery results both expire after a week
MAX_ATTEMPTS = 3  # a job whose worker died this many times (OOM kill, ...) fails instead of running again
HEARTBEAT_S = 10  # a running job's worker says it is alive this often
STALLED_AFTER_S = 6 * HEARTBEAT_S  # silent this long: its worker is presumed dead (the job view says so)
KEY_PREFIX = "tandem:job:"
RUNNING_PREFIX = "tandem:worker-running:"  # per worker hostname: the job ids it has started, not ended

_WORD = r"^[A-Za-z0-9][A-Za-z0-9_.:?=,+-]*$"  # a preset or GPU id: no '/', no leading '-'
ALL_GPUS = "all"  # BenchBwRequest.gpu: every GPU the worker sees, one profile each


class BenchBwRequest(BaseModel):
    """`tandem bench bw`: this host's bandwidths; the profile goes to the worker's profiles dir."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["bw"] = "bw"
    dtype: list[Literal["bfloat16", "float32", "fp8_block", "mxfp4"]] = Field(["bfloat16"], min_length=1, max_length=4)
    model: str = Field("synthetic:qwen3-30b-a3b", max_length=128, pattern=_WORD,
                       description="geometry: a synthetic preset 'NAME' or 'synthetic:NAME[?layers=N]'")
    gpu: str | None = Field(None, max_length=64, pattern=_WORD,
                            description="GPU UUID or index; 'all': every GPU the worker sees, one profile per GPU "
                            "UUID (one engine per GPU); unset: the first visible GPU")
    threshold: float = Field(DEFAULT_THRESHOLD, gt=0, le=100)
    seconds: float = Field(2.0, gt=0, le=60, description="wall time per measurement")
    buffer_mib: int = Field(1024, ge=1, le=65536)
    cpu_kernel: Literal["auto", "executor", "torch"] = "auto"

    def cli_args(self) -> list[str]:
        args = [f"--dtype={','.join(self.dtype)}", f"--model={self.model}", f"--threshold={self.threshold}",
                f"--seconds={self.seconds}", f"--buffer-mib={self.buffer_mib}", f"--cpu-kernel={self.cpu_kernel}"]
        return args + ([f"--gpu={self.gpu}"] if self.gpu else [])


class BenchLoadRequest(BaseModel):
    """`tandem bench load`: load a checkpoint's experts each way; the bank file goes under the
    worker's profiles dir (``banks/<checkpoint name>``) and is deleted unless ``keep_bank``."""

    model_config = ConfigDict(extra="forbid")
    kind: Literal["load"] = "load"
    model: str = Field(..., min_length=2, max_length=4096, description="checkpoint directory (absolute path)")
    modes: list[Literal["serial", "parallel", "repacked"]] = Field(["serial", "parallel", "repacked"],
                                                                     min_length=1, max_length=3)
    threads: int | None = Field(None, ge=1, le=256)
    chunk_mib: int = Field(16, ge=1, le=1024)
    keep_bank: bool = False
    drop_cache: bool = True

    @field_validator("model")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value:
            raise ValueError("model must be an absolute path to a checkpoint directory")
        return value

    def bank_name(self) -> str:
        """The bank file's directory name under ``<profiles>/banks``: the checkpoint's last path part
        with anything but [A-Za-z0-9_.-] replaced (never empty, never '.' or '..')."""
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", self.model.rstrip("/").rsplit("/", 1)[-1]).strip(".")
        return name or "checkpoint"

    def cli_args(self, bank_dir: str) -> list[str]:
        args = [f"--model={self.model}", f"--modes={','.join(self.modes)}", f"--chunk-mib={self.chunk_mib}",
                f"--bank-dir={bank_dir}"]
        args += [f"--threads={self.threads}"] if self.threads else []
        args += ["--keep-bank"] if self.keep_bank else []
        return args + ([] if self.drop_cache else ["--no-drop-cache"])


JobRequest = Annotated[Union[BenchBwRequest, BenchLoadRequest], Field(discriminator="kind")]
TASKS = {"bw": BENCH_BW_TASK, "load": BENCH_LOAD_TASK}


def node_queue(node: str) -> str:
    """The queue of the worker on ``node``: a job sent there measures that node's GPUs. The worker takes
    its node's name as given (a hostname may break the pattern below and must still get its queue);
    a client's node name is checked first (``check_node``)."""
    return f"{SHARED_QUEUE}.{node}"


def check_node(node: str) -> str:
    """``node`` when it is a node name (Kubernetes' RFC 1123 form, any case); raises ValueError otherwise."""
    if not re.match(NODE_PATTERN, node):
        raise ValueError(f"not a node name: {node!r} (letters, digits, '-' and '.', at most 253)")
    return node


def send_job(celery_app, store: "JobStore", request: BenchBwRequest | BenchLoadRequest, queue: str,
             node: str | None = None) -> str:
    """Record ``request`` and send its task to ``queue`` (``node``: the node whose queue it is) under the
    record's id; returns the job id. The record is written first, so the worker always finds it; a send
    that fails removes it."""
    body = request.model_dump(mode="json")
    job_id = store.create(request.kind, queue, body, node)
    try:
        celery_app.send_task(TASKS[request.kind], kwargs={"request": body}, queue=queue, task_id=job_id)
    except BaseException:
        store.delete(job_id)
        raise
    return job_id


class JobStore:
    """The job records in Redis (see the module docstring). Every call is one short round trip;
    connection errors propagate (``redis.RedisError``) for the caller to decide."""

    def __init__(self, redis_url: str, timeout_s: float = 5.0):
        import redis

        self.redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)

    def create(self, kind: str, queue: str, request: dict, node: str | None = None) -> str:
        """Record a new job about to be sent; returns its id (the Celery task id to send it under)."""
        job_id = str(uuid.uuid4())
        key = KEY_PREFIX + job_id
        with self.redis.pipeline() as pipe:
            pipe.hset(key, mapping={"kind": kind, "queue": queue, "request": json.dumps(request),
                                    "submitted_at": f"{time.time():.3f}", "attempts": 0, **({"node": node} if node else {})})
            pipe.expire(key, JOB_TTL_S)
            pipe.execute()
        return job_id

    def delete(self, job_id: str) -> None:
        self.redis.delete(KEY_PREFIX + job_id)

    def get(self, job_id: str) -> dict | None:
        """The record as a dict (request/progress parsed), or None for an unknown id."""
        raw = self.redis.hgetall(KEY_PREFIX + job_id)
        if not raw:
            return None
        rec = {k.decode(): v.decode() for k, v in raw.items()}
        for name in ("request", "progress"):
            if name in rec:
                rec[name] = json.loads(rec[name])
        rec["attempts"] = int(rec.get("attempts", 0))
        return rec

    def started(self, job_id: str, worker: str) -> int:
        """The worker starts (or restarts) the job: returns the attempt number, 1 for the first.
        Recreates a missing record (a job sent straight through Celery)."""
        key = KEY_PREFIX + job_id
        with self.redis.pipeline() as pipe:
            pipe.hincrby(key, "attempts", 1)
            now = f"{time.time():.3f}"
            pipe.hset(key, mapping={"worker": worker, "started_at": now, "heartbeat_at": now})
            pipe.hdel(key, "progress")
            pipe.expire(key, JOB_TTL_S)
            pipe.sadd(RUNNING_PREFIX + worker, job_id)
            attempts = pipe.execute()[0]
        return int(attempts)

    def heartbeat(self, job_id: str) -> None:
        self.redis.hset(KEY_PREFIX + job_id, "heartbeat_at", f"{time.time():.3f}")

    def progress(self, job_id: str, meta: dict) -> None:
        self.redis.hset(KEY_PREFIX + job_id, "progress", json.dumps(meta))

    def ended(self, job_id: str, worker: str) -> None:
        """The worker is done with the job (its end state is stored in Celery's result)."""
        self.redis.srem(RUNNING_PREFIX + worker, job_id)

    def interrupted(self, worker: str) -> list[str]:
        """Jobs ``worker`` started and never ended: at its start, those its previous life was running."""
        return sorted(m.decode() for m in self.redis.smembers(RUNNING_PREFIX + worker))

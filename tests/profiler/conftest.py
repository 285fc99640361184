"""Fixtures of the profiler tests: a small sharded MoE checkpoint, a real redis-server and a real
Celery worker. free_port / redis_server / celery_worker are generic: hoist them to tests/conftest.py
when another suite needs them."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.profiler import synth_checkpoint

ROOT = Path(__file__).resolve().parents[2]

# A Qwen3-MoE geometry small enough for CI; layer 1 is dense (mlp_only_layers) so MoE ordinals != ids.
CONFIG = dict(model_type="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
              num_experts=6, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
              intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True)


def write_checkpoint(directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """CONFIG's experts in ~64 KiB shards: every MoE layer's experts span several files, interleaved
    with router and attention tensors (as a size-based Hub split does)."""
    return synth_checkpoint.write_checkpoint(directory, CONFIG, dtype, shard_bytes=64 << 10)


@pytest.fixture
def moe_checkpoint(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------------------ services

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server on a free port, no persistence; yields its URL."""
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed (scripts/setup-system.sh installs it)"
    port = free_port()
    workdir = tmp_path_factory.mktemp("redis")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        assert proc.poll() is None, "redis-server exited at start"
        assert time.monotonic() < deadline, "redis-server did not answer PING in 20 s"
        time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def celery_worker(redis_server, tmp_path_factory):
    """A real `celery -A services.profiler.app worker` process against ``redis_server``. Yields
    (env dict the worker runs with, profiles dir, queue name)."""
    profiles = tmp_path_factory.mktemp("profiles")
    queue = f"tandem.test-{os.getpid()}"
    env = dict(os.environ, TANDEM_REDIS_URL=redis_server, TANDEM_PROFILES_DIR=str(profiles),
               TANDEM_PROFILER_QUEUE=queue, PYTHONPATH=str(ROOT))
    log = open(tmp_path_factory.mktemp("worker") / "worker.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "services.profiler.app", "worker",
                             "--loglevel", "INFO", "--pool", "prefork", "--concurrency", "1",
                             "--without-gossip", "--without-mingle", "--without-heartbeat",
                             "-n", f"test-{os.getpid()}@%h"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    from celery import Celery

    probe = Celery(broker=redis_server, backend=redis_server)
    deadline = time.monotonic() + 60
    while not probe.control.ping(timeout=0.5):
        if proc.poll() is not None:
            raise AssertionError(f"celery worker exited with {proc.returncode}; log: {log.name}")
        assert time.monotonic() < deadline, f"celery worker did not answer ping in 60 s; log: {log.name}"
    yield env, profiles, queue
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()

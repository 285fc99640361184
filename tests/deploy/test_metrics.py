"""The three metrics modules: backend stats -> counters, the gateway middleware, worker jobs and profiles."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from datetime import datetime, timezone

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import REGISTRY

from services.common.profiles import SCHEMA_VERSION, Profile, write_profile
from services.engine.metrics import EngineMetrics, render_metrics
from services.gateway.metrics import GatewayMetrics, PrometheusMiddleware
from services.profiler.metrics import ProfileCollector, WorkerMetrics, connect_celery_signals, read_profile_times


def value(name: str, **labels) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def fresh(prefix: str) -> str:
    """A unique label value, so tests sharing the process-wide registry never see each other's series."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def test_peer_fetched_counts_per_layer():
    """--moe-peer-devices: the cache's peer copies per layer (nested as the offload backend nests them)."""
    model = fresh("peer")
    metrics = EngineMetrics(model)
    metrics.record_backend_stats({"backend": "offload", "cache": {
        "hits": 4, "misses": 5, "fetched": 5, "peer_fetched": 3, "slots": 8, "peer": {"peer_slots": 16},
        "per_layer": {"hits": [1, 3], "misses": [2, 3], "fetched": [2, 3], "peer_fetched": [1, 2]}}})
    assert value("tandem_expert_peer_fetched_total", model_name=model, layer="0") == 1
    assert value("tandem_expert_peer_fetched_total", model_name=model, layer="1") == 2
    assert value("tandem_expert_cache_slots", model_name=model) == 8  # the home slots, not the peer's


def test_backend_stats_become_counter_increments():
    model = fresh("m")
    metrics = EngineMetrics(model)
    metrics.record_backend_stats({"hits": 10, "misses": 6, "fetched": 4, "cpu_computed": 2,
                                  "bytes_fetched": 4096, "fetch_fraction": 0.66, "slots": 12,
                                  "pcie_bytes_per_second": 5e10, "cpu_bytes_per_second": 7e10,
                                  "c_sync_seconds": 3e-5, "hit_rate": 0.6})
    # The offload backend nests the cache's counters: {"backend": "offload", "cache": {...}}.
    metrics.record_backend_stats({"backend": "hybrid", "cache": {"hits": 15, "misses": 9, "fetched": 6,
                                                                 "bytes_fetched": 6144}, "cpu_computed": 3,
                                  "prefetched": 5, "cpu_executor": {"worker_preemptions": 7}})
    assert value("tandem_expert_hits_total", model_name=model, layer="all") == 15
    assert value("tandem_expert_misses_total", model_name=model, layer="all") == 9
    assert value("tandem_expert_fetched_total", model_name=model, layer="all") == 6
    assert value("tandem_expert_cpu_computed_total", model_name=model, layer="all") == 3
    assert value("tandem_expert_fetched_bytes_total", model_name=model) == 6144
    assert value("tandem_expert_prefetched_total", model_name=model) == 5
    assert value("tandem_cpu_worker_preemptions_total", model_name=model) == 7  # hybrid's cpu_executor dict
    assert value("tandem_hybrid_fetch_fraction", model_name=model) == pytest.approx(0.66)
    assert value("tandem_bandwidth_bytes_per_second", model_name=model, path="cpu") == 7e10
    assert value("tandem_hybrid_sync_seconds", model_name=model) == pytest.approx(3e-5)
    assert value("tandem_expert_cache_slots", model_name=model) == 12
    # Backend rebuilt (profile reload): its counters restart at 0 -> the new value counts in full.
    metrics.record_backend_stats({"hits": 2, "misses": 1})
    assert value("tandem_expert_hits_total", model_name=model, layer="all") == 17
    assert value("tandem_expert_misses_total", model_name=model, layer="all") == 10


def test_per_layer_stats_replace_the_total():
    model = fresh("m")
    metrics = EngineMetrics(model)
    metrics.record_backend_stats({"hits": 7, "misses": 5, "per_layer": {"hits": [3, 4], "misses": [1, 4]}})
    metrics.record_backend_stats({"cache": {"hits": 9, "misses": 6, "per_layer": {"hits": [4, 5], "misses": [1, 5]}}})
    assert value("tandem_expert_hits_total", model_name=model, layer="0") == 4
    assert value("tandem_expert_hits_total", model_name=model, layer="1") == 5
    assert value("tandem_expert_misses_total", model_name=model, layer="1") == 5
    assert value("tandem_expert_hits_total", model_name=model, layer="all") is None  # no double count


def test_split_buckets_become_gauges_per_bucket():
    """hybrid's per-bucket split (top level after flat_backend_stats) and auto's (nested, offload running)."""
    from services.engine.reports import flat_backend_stats

    model = fresh("m")
    metrics = EngineMetrics(model)
    hybrid = {"backend": "hybrid", "cache": {"hits": 1, "misses": 1}, "split": {"fetch_fraction": 0.4},
              "buckets": {"1": {"mode": "hybrid", "fetch_fraction": 0.375, "seconds_per_token": 0.012},
                          "16": {"mode": "offload", "fetch_fraction": 1.0, "seconds_per_token": 0.004},
                          "prefill": {"mode": "offload", "fetch_fraction": 1.0, "seconds_per_token": None}},
              "auto": {"buckets": {"1": {"fetch_fraction": 0.9}}}}
    metrics.record_backend_stats(flat_backend_stats(hybrid))
    assert value("tandem_hybrid_bucket_fetch_fraction", model_name=model, bucket="1") == pytest.approx(0.375)
    assert value("tandem_hybrid_bucket_fetch_fraction", model_name=model, bucket="16") == 1.0
    assert value("tandem_hybrid_bucket_seconds_per_token", model_name=model, bucket="16") == pytest.approx(0.004)
    assert value("tandem_hybrid_bucket_fetch_fraction", model_name=model, bucket="prefill") == 1.0
    assert value("tandem_hybrid_bucket_seconds_per_token", model_name=model, bucket="prefill") is None
    other = fresh("m")
    EngineMetrics(other).record_backend_stats(flat_backend_stats(
        {"backend": "offload", "auto": {"buckets": {"4": {"mode": "offload", "fetch_fraction": 1.0}}}}))
    assert value("tandem_hybrid_bucket_fetch_fraction", model_name=other, bucket="4") == 1.0


def test_serving_metrics_and_exposition():
    model = fresh("m")
    metrics = EngineMetrics(model)
    assert value("tandem_generation_tokens_total", model_name=model) == 0  # series exist before traffic
    metrics.observe_step(num_running=2, num_waiting=1, kv_cache_usage=0.25, prompt_tokens=11, generation_tokens=2,
                         cached_tokens=4)
    metrics.observe_step(num_running=1, num_waiting=0, kv_cache_usage=0.5, generation_tokens=1)
    metrics.observe_first_token(0.03)
    metrics.observe_inter_token(0.02)
    metrics.observe_request_finished(e2e_seconds=0.7, finish_reason="length")
    assert value("tandem_prompt_tokens_total", model_name=model) == 11
    assert value("tandem_prompt_tokens_cached_total", model_name=model) == 4
    assert value("tandem_generation_tokens_total", model_name=model) == 3
    assert value("tandem_num_requests_running", model_name=model) == 1
    assert value("tandem_kv_cache_usage_ratio", model_name=model) == 0.5
    assert value("tandem_time_to_first_token_seconds_count", model_name=model) == 1
    assert value("tandem_e2e_request_latency_seconds_sum", model_name=model) == pytest.approx(0.7)
    assert value("tandem_request_success_total", model_name=model, finish_reason="length") == 1
    assert value("tandem_request_success_total", model_name=model, finish_reason="stop") == 0
    body, content_type = render_metrics()
    assert content_type.startswith("text/plain")
    assert f'tandem_inter_token_latency_seconds_bucket{{le="0.025",model_name="{model}"}} 1.0' in body.decode()


async def _stream():
    for chunk in (b"data: a\n\n", b"data: b\n\n", b"data: [DONE]\n\n"):
        yield chunk


def _gateway_app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(PrometheusMiddleware)

    @app.get("/v1/models/{model_id}")
    async def one_model(model_id: str, request: Request):
        request.state.model_name = model_id
        return {"id": model_id}

    @app.post("/v1/stream")
    async def stream(request: Request):
        request.state.model_name = "streamer"
        return StreamingResponse(_stream(), media_type="text/event-stream")

    return app


def test_gateway_middleware_counts_by_route_template_and_status():
    asyncio.run(_gateway_requests())


async def _gateway_requests():
    model = fresh("gw")
    before_404 = value("tandem_gateway_requests_total", model_name="", route="unmatched", status="404") or 0
    before_stream = value("tandem_gateway_requests_total", model_name="streamer", route="/v1/stream",
                          status="200") or 0
    transport = httpx.ASGITransport(app=_gateway_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        assert (await client.get(f"/v1/models/{model}")).status_code == 200
        assert (await client.get("/no/such/path")).status_code == 404
        resp = await client.post("/v1/stream")
        assert resp.text.endswith("[DONE]\n\n")
    assert value("tandem_gateway_requests_total", model_name=model, route="/v1/models/{model_id}",
                 status="200") == 1
    assert value("tandem_gateway_requests_total", model_name="", route="unmatched", status="404") == before_404 + 1
    assert value("tandem_gateway_requests_total", model_name="streamer", route="/v1/stream",
                 status="200") == before_stream + 1
    assert value("tandem_gateway_request_duration_seconds_count", model_name=model,
                 route="/v1/models/{model_id}") == 1
    assert value("tandem_gateway_requests_in_flight") == 0
    engine = fresh("http://engine")
    GatewayMetrics.set_engine_health(engine, False)
    assert value("tandem_gateway_engine_up", engine=engine) == 0
    GatewayMetrics.set_engine_health(engine, True)
    assert value("tandem_gateway_engine_up", engine=engine) == 1


def test_worker_job_metrics_from_celery_signals():
    from celery import Celery

    app = Celery("metrics-test", broker="memory://", backend="cache+memory://")
    app.conf.task_always_eager = True
    name = fresh("job")

    @app.task(name=f"tests.{name}")
    def job(fail: bool):
        if fail:
            raise RuntimeError("bench failed")
        return 1

    connect_celery_signals()
    job.apply(args=(False,))
    job.apply(args=(True,))
    assert value("tandem_profiler_jobs_total", task=name, state="started") == 2
    assert value("tandem_profiler_jobs_total", task=name, state="succeeded") == 1
    assert value("tandem_profiler_jobs_total", task=name, state="failed") == 1
    assert value("tandem_profiler_job_failures_total", task=name, exception="RuntimeError") == 1
    assert value("tandem_profiler_job_duration_seconds_count", task=name) == 2
    assert value("tandem_profiler_jobs_running", task=name) == 0
    other = fresh("job")
    WorkerMetrics.declare_tasks([f"tandem.{other}"])  # at worker_ready: series exist before any job
    assert value("tandem_profiler_jobs_total", task=other, state="succeeded") == 0
    assert value("tandem_profiler_jobs_running", task=other) == 0
    WorkerMetrics.job_finished(name, "never-started", ok=True)  # unknown id: counted, no negative gauge
    assert value("tandem_profiler_jobs_running", task=name) == 0


def _profile(uuid: str, created_at: str) -> Profile:
    return Profile(schema_version=SCHEMA_VERSION, gpu={"uuid": uuid}, host={"physical_cores": 2},
                   created_at=created_at, tandem_version="test", ceilings={"cpu_read": 10.0},
                   kernels={"bfloat16": {"cpu_executor_bs1": 5.0}}, c_sync_s=1e-5,
                   geometry={"model": "demo", "num_layers": 2, "num_experts": 8, "top_k": 2,
                             "hidden_size": 64, "moe_intermediate_size": 32})


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


def test_profile_collector_present_and_age(tmp_path):
    now = time.time()
    write_profile(_profile("GPU-AAA", _iso(now - 3 * 86400)), tmp_path)
    write_profile(_profile("gpu-bbb", "2020-01-01T00:00:00Z"), tmp_path)
    (tmp_path / "GPU-ccc.json").write_text("{not json")  # corrupt: as good as no profile
    assert set(read_profile_times(tmp_path)) == {"GPU-aaa", "GPU-bbb"}

    # NVML spells uuids "GPU-<hex>"; ccc has only a corrupt file, ddd none.
    collector = ProfileCollector(lambda: tmp_path, lambda: ["GPU-aaa", "GPU-ccc", "GPU-ddd"])
    families = {f.name: {s.labels["gpu"]: s.value for s in f.samples} for f in collector.collect()}
    assert families["tandem_profile_present"] == {"GPU-aaa": 1, "GPU-bbb": 1, "GPU-ccc": 0, "GPU-ddd": 0}
    ages = families["tandem_profile_age_seconds"]
    assert set(ages) == {"GPU-aaa", "GPU-bbb"}
    assert ages["GPU-aaa"] == pytest.approx(3 * 86400, abs=60)
    assert ages["GPU-bbb"] > 5 * 365 * 86400


def test_profile_collector_survives_a_failing_gpu_listing(tmp_path):
    def broken() -> list[str]:
        raise RuntimeError("NVML: driver/library version mismatch")

    families = {f.name: f.samples for f in ProfileCollector(lambda: tmp_path / "absent", broken).collect()}
    assert families == {"tandem_profile_present": [], "tandem_profile_age_seconds": []}


def test_worker_metrics_server_serves_profiles_and_names_a_taken_port(tmp_path):
    write_profile(_profile("GPU-eee", _iso(time.time() - 60)), tmp_path)
    with socket.socket() as blocker, socket.socket() as probe:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        probe.bind(("127.0.0.1", 0))
        taken, port = blocker.getsockname()[1], probe.getsockname()[1]
        probe.close()
        code = ("import time; from services.profiler.metrics import start_worker_metrics_server as start\n"
                f"try:\n    start({taken}, addr='127.0.0.1')\nexcept OSError as e:\n    print(e, flush=True)\n"
                f"start({port}, addr='127.0.0.1', list_gpus=lambda: ['GPU-fff']); print('up', flush=True)\n"
                "time.sleep(60)\n")
        env = {**os.environ, "TANDEM_PROFILES_DIR": str(tmp_path)}
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        try:
            assert f"port {taken} is taken" in proc.stdout.readline()
            assert proc.stdout.readline().strip() == "up"
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        finally:
            proc.kill()
            proc.wait()
    assert 'tandem_profile_present{gpu="GPU-eee"} 1.0' in text
    assert 'tandem_profile_present{gpu="GPU-fff"} 0.0' in text
    assert 'tandem_profile_age_seconds{gpu="GPU-eee"}' in text
    assert "tandem_profiler_jobs_total" in text


@pytest.mark.gpu
def test_nvml_lists_the_gpus_torch_sees():
    """On a GPU host the worker's GPU list (NVML, for tandem_profile_present) names every CUDA device
    with the uuid the profiles are keyed by (needs nvidia-ml-py, the `worker` extra)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from services.common.profiles import normalize_uuid
    from services.profiler.metrics import nvml_gpu_uuids

    uuids = [normalize_uuid(u) for u in nvml_gpu_uuids()]
    assert len(uuids) >= torch.cuda.device_count() > 0
    torch_uuid = normalize_uuid(str(torch.cuda.get_device_properties(0).uuid))
    assert torch_uuid in uuids, (torch_uuid, uuids)

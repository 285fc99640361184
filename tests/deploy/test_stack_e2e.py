"""The whole observability path, for real: redis-server, the Celery worker, the engine (demo model,
hybrid backend), the gateway and Prometheus run as subprocesses on free ports (services/local_stack.py,
the code behind `make run`, with a 1 s scrape interval). After a few OpenAI requests and one profile
job, every Grafana panel's PromQL must return data, and the counters must agree with what the
clients saw and with the engine's stats JSON."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import httpx
import pytest

from services.local_stack import Stack, StackConfig
from tests.deploy.net import free_ports
from tests.deploy.promql import REPO, dashboard_panels, panel_queries

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "e2e-admin-token"
# hybrid: the only backend that feeds every expert panel (fetched and CPU-computed misses, f,
# bandwidths, c_sync), with the next layer's experts prefetched for the read-ahead panel.
# Half the experts cached, so both hits and misses happen.
ENGINE_ARGS = ["--moe-backend", "hybrid", "--moe-cache-rate", "0.5", "--max-running-requests", "4",
               "--moe-prefetch", "1"]
# A quick CPU-only profile: the worker runs `tandem bench bw` with these flags.
PROFILE_REQUEST = {"kind": "bw", "seconds": 0.2, "buffer_mib": 32}
RATE_INTERVAL = "10m"  # covers the whole test, so each rate() spans all of its traffic


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stack")
    gateway, engine, redis, worker, prometheus = free_ports(5)
    env = {**os.environ, "TANDEM_PROFILES_DIR": str(tmp / "profiles"), "TANDEM_ADMIN_TOKEN": ADMIN_TOKEN,
           "TANDEM_API_KEYS": "", "TANDEM_PROFILER_QUEUE": f"tandem.profiler.e2e-{redis}"}
    config = StackConfig(model="demo", port=gateway, engine_port=engine, redis_port=redis,
                         worker_metrics_port=worker, prometheus_port=prometheus, scrape_interval="1s",
                         runs_dir=str(tmp), ready_timeout=600)
    with Stack(config, ENGINE_ARGS, env) as running:
        yield running


def prom_query(stack: Stack, expr: str) -> list[dict]:
    resp = httpx.get(f"http://127.0.0.1:{stack.config.prometheus_port}/api/v1/query", params={"query": expr},
                     timeout=30)
    body = resp.json()
    assert resp.status_code == 200 and body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


def prom_scalar(stack: Stack, expr: str) -> float:
    result = prom_query(stack, expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def routed_per_token(model_dir: Path) -> int:
    """top_k x MoE layers, from the checkpoint's config.json (qwen3_moe layer rule), not from engine code."""
    cfg = json.loads((model_dir / "config.json").read_text())
    step = cfg.get("decoder_sparse_step", 1)
    moe_layers = [i for i in range(cfg["num_hidden_layers"])
                  if i not in cfg.get("mlp_only_layers", []) and (i + 1) % step == 0]
    return cfg["num_experts_per_tok"] * len(moe_layers)


@pytest.fixture(scope="module")
def traffic(stack):
    """A few requests through the gateway (chat, completions, a stream, one 404); the clients' token
    counts, and Prometheus' token counters once it has scraped the result."""
    from openai import NotFoundError, OpenAI

    _wait_for_targets(stack)  # a series Prometheus first sees at 1 shows no increase in rate()
    client = OpenAI(base_url=f"http://127.0.0.1:{stack.config.port}/v1", api_key="unused", max_retries=0,
                    timeout=300)
    model = client.models.list().data[0].id
    usages = []
    # the chats share a system prompt longer than a KV block (16 tokens): the prefix cache shares whole blocks
    system = {"role": "system", "content": "You are a helpful assistant. Answer in one short sentence, plainly."}
    for i in range(3):
        resp = client.chat.completions.create(model=model, messages=[system, {"role": "user", "content": f"hello {i}"}],
                                              max_tokens=6 + i, temperature=0)
        usages.append(resp.usage)
    usages.append(client.completions.create(model=model, prompt="the quick brown fox", max_tokens=5,
                                            temperature=0).usage)
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "stream"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    usages.append([c for c in stream if c.usage is not None][-1].usage)
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])

    completion = sum(u.completion_tokens for u in usages)
    _wait_for_scrape(stack, completion)
    # Snapshot now: later tests send more traffic straight to the engine.
    seen = {name: prom_scalar(stack, f"sum({name})") for name in
            ("tandem_generation_tokens_total", "tandem_prompt_tokens_total", "tandem_prompt_tokens_cached_total",
             "tandem_request_success_total")}
    return {"prompt": sum(u.prompt_tokens for u in usages), "completion": completion, "requests": len(usages),
            "prometheus": seen}


@pytest.fixture(scope="module")
def profile_job(stack):
    """One bandwidth profile job through the admin API, run by the worker; its final job view."""
    base = f"http://127.0.0.1:{stack.config.port}"
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    resp = httpx.post(f"{base}/admin/profiles", json=PROFILE_REQUEST, headers=admin, timeout=30)
    assert resp.status_code == 202, resp.text
    job_id = resp.json()["id"]
    start_by, end_by = time.monotonic() + 90, time.monotonic() + 600
    while True:
        job = httpx.get(f"{base}/admin/jobs/{job_id}", headers=admin, timeout=30).json()
        if job["state"] in ("SUCCESS", "FAILURE"):
            break
        assert not (job["state"] == "PENDING" and time.monotonic() > start_by), (
            f"job {job_id} still PENDING after 90 s: no worker took it (does the worker consume the queue "
            f"the gateway sends to?) {stack.log_tail('worker', 10)}")
        assert time.monotonic() < end_by, f"job {job_id} not done after 600 s: {job}"
        time.sleep(1)
    assert job["state"] == "SUCCESS", job
    time.sleep(3)  # > 2 scrape intervals: the worker's counters and the new profile are in Prometheus
    return job


def _wait_for_targets(stack: Stack) -> None:
    deadline = time.monotonic() + 60
    while True:
        ups = prom_query(stack, "up")
        if len(ups) == 3 and all(u["value"][1] == "1" for u in ups):
            time.sleep(2.5)  # two more scrapes: every series has a sample before the traffic
            return
        assert time.monotonic() < deadline, f"Prometheus targets not all up: {ups}"
        time.sleep(0.5)


def _wait_for_scrape(stack: Stack, completion: int) -> None:
    """Until Prometheus holds a scrape of every target taken after the traffic (2 s of 1 s scrapes
    past the moment the engine's counter shows all generated tokens)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ups = prom_query(stack, "up")
        tokens = prom_query(stack, "sum(tandem_generation_tokens_total)")
        if len(ups) == 3 and all(u["value"][1] == "1" for u in ups) and tokens \
                and float(tokens[0]["value"][1]) >= completion:
            time.sleep(2.5)
            return
        time.sleep(0.5)
    raise AssertionError(f"Prometheus never scraped the traffic: up={prom_query(stack, 'up')}")


def test_every_panel_has_data(stack, traffic, profile_job):
    empty = []
    for title, expr in panel_queries(RATE_INTERVAL):
        values = [float(r["value"][1]) for r in prom_query(stack, expr)]
        if not any(math.isfinite(v) for v in values):
            empty.append(f"{title}: {expr} -> {values or 'no series'}")
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_token_counters_match_what_the_clients_saw(stack, traffic):
    seen = traffic["prometheus"]
    assert seen["tandem_generation_tokens_total"] == traffic["completion"]
    # every prompt token was either prefilled or taken from the prefix cache (the chats share a system prompt)
    assert seen["tandem_prompt_tokens_cached_total"] > 0
    assert seen["tandem_prompt_tokens_total"] + seen["tandem_prompt_tokens_cached_total"] == traffic["prompt"]
    assert seen["tandem_request_success_total"] == traffic["requests"]
    assert prom_scalar(stack, 'sum(tandem_gateway_requests_total{route="/v1/chat/completions", status="404"})') == 1


def expert_lookups(stack: Stack) -> tuple[float, dict]:
    """(hits + misses in Prometheus, the engine's expert-cache stats JSON) at one quiet moment."""
    cache = httpx.get(f"http://127.0.0.1:{stack.config.engine_port}/engine/v1/stats", timeout=30).json()
    cache = cache["expert_cache"]
    cache = {**cache.get("cache", {}), **cache}  # the offload backend nests the cache's counters
    return prom_scalar(stack, "sum(tandem_expert_hits_total) + sum(tandem_expert_misses_total)"), cache


def test_expert_counters_match_the_routing_and_the_engine_stats(stack, traffic):
    """The cache counts each expert a step routes to once per layer. One-token prompts sent one at a
    time make every step a single token, whose A top-k experts are distinct: each generated token
    then routes exactly A experts in each MoE layer, so hits + misses grow by tokens x A x L."""
    before, before_json = expert_lookups(stack)
    assert before == before_json["hits"] + before_json["misses"]
    engine = f"http://127.0.0.1:{stack.config.engine_port}/engine/v1/generate"
    generated = 0
    for i in range(3):
        body = {"request_id": f"e2e-experts-{i}", "prompt_token_ids": [11 + i],
                "sampling": {"max_tokens": 4 + i, "temperature": 0, "ignore_eos": True}}
        with httpx.stream("POST", engine, json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            last = [json.loads(line) for line in resp.iter_lines() if line.strip()][-1]
        assert last["completion_tokens"] == 4 + i
        generated += last["completion_tokens"]
    _wait_for_scrape(stack, traffic["completion"] + generated)

    from services.engine.models.demo import ensure_demo_checkpoint

    after, after_json = expert_lookups(stack)
    routed = generated * routed_per_token(ensure_demo_checkpoint())  # the engine's checkpoint
    assert after - before == routed, f"hits + misses grew by {after - before}, routed experts {routed}"
    assert after == after_json["hits"] + after_json["misses"], "Prometheus disagrees with /engine/v1/stats"
    hits = prom_scalar(stack, "sum(tandem_expert_hits_total)")
    misses = prom_scalar(stack, "sum(tandem_expert_misses_total)")
    assert (hits, misses) == (after_json["hits"], after_json["misses"])
    assert hits > 0 and misses > 0
    fetched = prom_scalar(stack, "sum(tandem_expert_fetched_total)")
    cpu = prom_scalar(stack, "sum(tandem_expert_cpu_computed_total)")
    assert fetched + cpu == misses, f"every miss is fetched ({fetched}) or computed on the CPU ({cpu})"


def test_profile_job_and_profile_metrics(stack, profile_job):
    assert prom_scalar(stack, 'sum(tandem_profiler_jobs_total{state="succeeded"})') == 1
    assert prom_scalar(stack, "sum(tandem_profiler_jobs_total{state=\"failed\"}) or vector(0)") == 0
    present = prom_query(stack, "tandem_profile_present")
    assert [p["value"][1] for p in present] == ["1"], present
    assert prom_scalar(stack, "max(tandem_profile_age_seconds)") < 600


def test_alert_rules_are_loaded_and_quiet(stack):
    deadline = time.monotonic() + 30
    while True:  # health is "unknown" until the first evaluation (1 s interval here)
        groups = httpx.get(f"http://127.0.0.1:{stack.config.prometheus_port}/api/v1/rules", timeout=30).json()
        rules = [r for g in groups["data"]["groups"] for r in g["rules"]]
        if all(r["health"] != "unknown" for r in rules) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(rules) >= 6 and all(r["health"] == "ok" for r in rules), rules
    firing = [r["name"] for r in rules if r["state"] == "firing"]
    assert not firing, firing


def test_the_readme_picture_renders_every_panel_from_prometheus(stack, traffic, profile_job, tmp_path):
    """deploy/grafana/render_panels.py (the README's picture of the dashboard) draws each panel from the
    same Prometheus: every panel has a series with data, and the PNG is written."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_panels", REPO / "deploy" / "grafana" / "render_panels.py")
    render_panels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(render_panels)
    png = tmp_path / "dashboard.png"
    counts = render_panels.render(f"http://127.0.0.1:{stack.config.prometheus_port}", png, minutes=10,
                                  rate_interval=RATE_INTERVAL)
    assert len(counts) == len(dashboard_panels())
    assert [title for title, n in counts.items() if n == 0] == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

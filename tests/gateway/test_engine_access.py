"""The engine's internal API belongs to the gateway (issue 20 item 6): real `tandem engine`,
`tandem gateway` and `tandem serve` processes, real HTTP."""

from __future__ import annotations

import time

import httpx
import openai

from benchmarks.server_process import free_port
from tests.conftest import TandemProcess

TOKEN = "engine-secret"
GENERATE = {"prompt_token_ids": [1, 2, 3], "sampling": {"max_tokens": 2}}
CONTROL = [("/engine/v1/generate", GENERATE), ("/engine/v1/abort", {"request_id": "x"}),
           ("/engine/v1/reload-profile", None)]


def test_engine_token_guards_every_internal_route(engine_process, gateway_process):
    engine = engine_process("--model", "demo", "--max-seq-len", "128", env={"TANDEM_ENGINE_TOKEN": TOKEN})
    for path, body in [*CONTROL, ("/engine/v1/info", None), ("/engine/v1/stats", None)]:
        for headers in ({}, {"Authorization": "Bearer not-it"}):
            r = httpx.request("POST" if path in dict(CONTROL) else "GET", engine.url + path, json=body,
                              headers=headers, timeout=10)
            assert r.status_code == 401, (path, r.text)
            assert r.json()["error"]["code"] == 401 and "TANDEM_ENGINE_TOKEN" in r.json()["error"]["message"]
    ok = httpx.post(engine.url + "/engine/v1/generate", json=GENERATE, timeout=30,
                    headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.text.strip().splitlines()
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200  # health checks, Prometheus
    assert httpx.get(engine.url + "/metrics", timeout=10).status_code == 200
    # the gateway sends the token it finds in the same variable
    gateway = gateway_process("--engine", engine.url, env={"TANDEM_ENGINE_TOKEN": TOKEN})
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)
    out = client.completions.create(model="tandem-demo", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_engine_refuses_a_body_over_its_limit(engine_process):
    engine = engine_process("--model", "demo", "--max-seq-len", "128")
    big = {"prompt_token_ids": [1] * 200_000, "sampling": {"max_tokens": 1}}
    r = httpx.post(engine.url + "/engine/v1/generate", json=big, timeout=30)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: counted while read
        yield b'{"prompt_token_ids": ['
        for _ in range(100):
            yield b"1, " * 1000
        yield b'1], "sampling": {}}'

    r = httpx.post(engine.url + "/engine/v1/generate", content=chunks(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413, r.text
    assert httpx.get(engine.url + "/health", timeout=10).status_code == 200


def test_engine_on_all_interfaces_without_a_token_warns(tmp_path, service_env):
    port = free_port()
    engine = TandemProcess(["engine", "--model", "demo", "--max-seq-len", "64", "--host", "0.0.0.0", "--port",
                            str(port)], tmp_path / "engine.log", service_env, port)
    try:
        deadline = time.monotonic() + 60
        while "without TANDEM_ENGINE_TOKEN" not in engine.log_tail(200):
            assert engine.proc.poll() is None and time.monotonic() < deadline, engine.log_tail()
            time.sleep(0.2)
    finally:
        engine.stop()


def test_serve_api_key_does_not_reach_the_engine_controls(serve_process):
    server = serve_process("--model", "demo", "--max-seq-len", "128", "--api-key", "sk-user")
    user = {"Authorization": "Bearer sk-user"}
    for path, body in CONTROL:
        r = httpx.post(server.url + path, json=body, headers=user, timeout=30)
        assert r.status_code == 404, (path, r.status_code, r.text)
    assert httpx.get(server.url + "/engine/v1/stats", headers=user, timeout=10).status_code == 200
    with_token = serve_process("--model", "demo", "--max-seq-len", "128", "--api-key", "sk-user",
                               env={"TANDEM_ENGINE_TOKEN": TOKEN})
    r = httpx.post(with_token.url + "/engine/v1/generate", json=GENERATE, headers=user, timeout=30)
    assert r.status_code == 401
    r = httpx.post(with_token.url + "/engine/v1/generate", json=GENERATE, timeout=30,
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text

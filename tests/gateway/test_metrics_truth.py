"""Metrics that tell the truth (issue 20 item 9), on real `tandem engine` / `tandem gateway` processes:
the queue and KV gauges follow disconnects, and a request ended by a stop string counts as `stop`."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest


def _metric(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    pattern = rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$"
    values = [float(v) for v in re.findall(pattern, text, re.M)]
    assert values, f"{name}{{{labels}}} not exported"
    return sum(values)


@pytest.fixture(scope="module")
def stack(engine_process, gateway_process):
    engine = engine_process("--model", "demo", "--max-seq-len", "4096", "--max-running-requests", "4")
    gateway = gateway_process("--engine", engine.url)
    return engine, gateway


def test_gauges_drop_when_clients_disconnect(stack):
    engine, _ = stack
    body = {"prompt_token_ids": [1, 2, 3, 4], "sampling": {"max_tokens": 4000, "ignore_eos": True}}
    clients = [httpx.Client(timeout=60) for _ in range(6)]  # 4 running, 2 waiting
    streams = []
    try:
        for client in clients:
            streams.append(client.send(client.build_request("POST", engine.url + "/engine/v1/generate", json=body),
                                       stream=True))
        lines = [s.iter_lines() for s in streams]  # kept: a dropped iterator closes its stream
        for it in lines[:4]:
            next(it)  # running: a token came out
        deadline = time.monotonic() + 30
        while _metric(engine.url, "tandem_num_requests_waiting") < 1:
            assert time.monotonic() < deadline, "never saw a waiting request"
            time.sleep(0.1)
        assert _metric(engine.url, "tandem_num_requests_running") == 4
        assert _metric(engine.url, "tandem_kv_cache_usage_ratio") > 0
    finally:
        for s in streams:
            s.close()  # the clients go away mid-generation
        for client in clients:
            client.close()
    deadline = time.monotonic() + 30
    while (_metric(engine.url, "tandem_num_requests_running"), _metric(engine.url, "tandem_num_requests_waiting"),
           _metric(engine.url, "tandem_kv_cache_usage_ratio")) != (0, 0, 0):
        assert time.monotonic() < deadline, httpx.get(engine.url + "/metrics", timeout=10).text[-3000:]
        time.sleep(0.2)
    assert httpx.get(engine.url + "/engine/v1/stats", timeout=10).json()["running"] == 0


def test_a_stop_string_ends_a_request_as_stop_not_abort(stack):
    engine, gateway = stack
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=120)
    kw = dict(model="tandem-demo", prompt="Hello there", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=24, **kw).choices[0].text
    stop = text[8:12]  # greedy: the same text comes again, and this stops it early
    assert stop.strip(), text
    stopped = {r: _metric(engine.url, "tandem_request_success_total", f'finish_reason="{r}"') for r in ("stop", "abort")}
    out = client.completions.create(max_tokens=2000, stop=[stop], **kw).choices[0]
    assert out.finish_reason == "stop" and stop not in out.text and len(out.text) < len(text)
    deadline = time.monotonic() + 30
    while _metric(engine.url, "tandem_request_success_total", 'finish_reason="stop"') != stopped["stop"] + 1:
        assert time.monotonic() < deadline, "the stop-string finish was not counted as stop"
        time.sleep(0.2)
    assert _metric(engine.url, "tandem_request_success_total", 'finish_reason="abort"') == stopped["abort"]

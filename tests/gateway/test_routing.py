"""Two engines behind one gateway: least-outstanding routing spreads concurrent requests over both;
with one engine dead, requests fail over to the other (no error while one is healthy)."""

from __future__ import annotations

import concurrent.futures

import httpx

MODEL = "tandem-demo"


def _complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "Route me", "max_tokens": 24,
                                                    "temperature": 0, "ignore_eos": True}, timeout=120)


def _finished(engine) -> int:
    return httpx.get(engine.url + "/engine/v1/stats", timeout=10).json()["requests_finished"]


def test_requests_spread_over_engines_and_survive_one_down(engine_process, gateway_process):
    engines = [engine_process("--model", "demo", "--max-seq-len", "128") for _ in range(2)]
    gateway = gateway_process("--engine", ",".join(e.url for e in engines), "--health-interval-s", "0.3")
    models = httpx.get(gateway.url + "/v1/models", timeout=10).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: _complete(gateway.url), range(6)))
    assert all(r.status_code == 200 for r in responses)
    assert len({r.json()["choices"][0]["text"] for r in responses}) == 1  # same greedy text from both engines
    counts = [_finished(e) for e in engines]
    assert sum(counts) == 6 and min(counts) >= 1, counts

    engines[0].kill()  # requests routed to the dead engine fail over to the live one: no error at all
    statuses = [_complete(gateway.url).status_code for _ in range(4)]
    assert statuses == [200] * 4
    assert _finished(engines[1]) == counts[1] + 4

"""Back-pressure and engine failure through the gateway: a full waiting queue answers 429 with
Retry-After (after the other engines serving the model were tried); an engine that dies gives 503 and
is taken back once it is healthy again."""

from __future__ import annotations

import threading
import time

import httpx

MODEL = "tandem-demo"


def _stream_forever(url: str, started: threading.Event, stop: threading.Event) -> None:
    body = {"model": MODEL, "prompt": "Keep talking", "max_tokens": 2000, "temperature": 0, "stream": True,
            "ignore_eos": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                started.set()
                if stop.is_set():
                    return
    except httpx.HTTPError:
        pass
    finally:
        started.set()


def _fill(engine, gateway_url: str, stop: threading.Event) -> list[threading.Thread]:
    """Take an engine's one running slot and its one waiting place with endless streams via gateway_url."""
    threads = []
    for _ in range(2):
        started = threading.Event()
        threads.append(threading.Thread(target=_stream_forever, args=(gateway_url, started, stop), daemon=True))
        threads[-1].start()
        if len(threads) == 1:
            assert started.wait(60)  # running before the second one queues
    deadline = time.monotonic() + 30
    while httpx.get(engine.url + "/engine/v1/stats", timeout=10).json()["waiting"] < 1:
        assert time.monotonic() < deadline, "second request never queued"
        time.sleep(0.1)
    return threads


def _complete_until(url: str, status: int, why: str, timeout_s: float = 30.0) -> httpx.Response:
    """Send a small completion every 0.25 s until the gateway answers ``status``; that response."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        if r.status_code == status:
            return r
        assert time.monotonic() < deadline, f"{why}: {r.status_code} {r.text}"
        time.sleep(0.25)


def test_queue_full_429_then_engine_down_503_and_recovery(engine_process, gateway_process, free_port):
    engine = engine_process("--model", "demo", "--max-seq-len", "2048", "--max-running-requests", "1",
                            "--max-waiting-requests", "1", port=free_port)
    gateway = gateway_process("--engine", engine.url, "--health-interval-s", "0.3")
    stop = threading.Event()
    threads = _fill(engine, gateway.url, stop)
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") and r.json()["error"]["type"] == "rate_limit_error"
    stop.set()
    for t in threads:
        t.join(60)

    engine.kill()
    r = _complete_until(gateway.url, 503, "gateway never reported the engine down")
    assert r.json()["error"]["message"]
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 503

    engine.start()  # same port: the gateway must take it back on its own
    engine.wait_healthy()
    r = _complete_until(gateway.url, 200, "gateway never took the engine back")
    assert r.json()["usage"]["completion_tokens"] >= 1


def test_a_full_engine_passes_the_request_to_another(engine_process, gateway_process):
    """Engine A's queue is full through another gateway; the routing gateway sees no load on A (tie: A
    first), gets A's 429 and sends the request to B instead of failing it. Both full: the client gets 429."""
    a, b = (engine_process("--model", "demo", "--max-seq-len", "2048", "--max-running-requests", "1",
                           "--max-waiting-requests", "1") for _ in range(2))
    stop = threading.Event()
    threads = _fill(a, gateway_process("--engine", a.url).url, stop)
    try:
        gateway = gateway_process("--engine", f"{a.url},{b.url}")
        before = httpx.get(b.url + "/engine/v1/stats", timeout=10).json()["requests_finished"]
        r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert httpx.get(b.url + "/engine/v1/stats", timeout=10).json()["requests_finished"] == before + 1
        threads += _fill(b, gateway_process("--engine", b.url).url, stop)
        r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "and more", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 429 and r.headers.get("retry-after"), r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        stop.set()
        for t in threads:
            t.join(60)

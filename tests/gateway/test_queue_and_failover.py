"""Back-pressure and engine failure through the gateway: a full waiting queue answers 429 with
Retry-After; an engine that dies gives 503 and is taken back once it is healthy again."""

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


def test_queue_full_429_then_engine_down_503_and_recovery(engine_process, gateway_process, free_port):
    engine = engine_process("--model", "demo", "--max-seq-len", "2048", "--max-running-requests", "1",
                            "--max-waiting-requests", "1", port=free_port)
    gateway = gateway_process("--engine", engine.url, "--health-interval-s", "0.3")
    stop = threading.Event()
    running, waiting = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_stream_forever, args=(gateway.url, running, stop), daemon=True)]
    threads[0].start()
    assert running.wait(60)  # the one slot is taken
    threads.append(threading.Thread(target=_stream_forever, args=(gateway.url, waiting, stop), daemon=True))
    threads[1].start()
    deadline = time.monotonic() + 30
    while httpx.get(engine.url + "/engine/v1/stats", timeout=10).json()["waiting"] < 1:
        assert time.monotonic() < deadline, "second request never queued"
        time.sleep(0.1)
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "one more", "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 429, r.text
    assert r.headers.get("retry-after") and r.json()["error"]["type"] == "rate_limit_error"
    stop.set()
    for t in threads:
        t.join(60)

    engine.kill()
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        if r.status_code == 503:
            break
        assert time.monotonic() < deadline, f"gateway never reported the engine down: {r.status_code} {r.text}"
        time.sleep(0.2)
    assert r.json()["error"]["message"]
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 503

    engine.start()  # same port: the gateway must take it back on its own
    engine.wait_healthy()
    deadline = time.monotonic() + 30
    while True:
        r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                       timeout=30)
        if r.status_code == 200:
            break
        assert time.monotonic() < deadline, f"gateway never took the engine back: {r.status_code} {r.text}"
        time.sleep(0.3)
    assert r.json()["usage"]["completion_tokens"] >= 1

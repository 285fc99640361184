"""What one client may hold of `tandem gateway`, and how it stops (issue 20 items 8 and 10), with real
processes, raw sockets and real signals: slow heads and bodies get 408 and are closed, connections past
--max-connections get a JSON 503, /health never waits on a frozen engine, and SIGTERM drains the requests
in flight for --shutdown-grace-s before ending each as its client can read it."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

MODEL = "tandem-demo"


@pytest.fixture(scope="module")
def engine(engine_process):
    return engine_process("--model", "demo", "--max-seq-len", "4096", "--max-running-requests", "4")


def _read_until_closed(sock: socket.socket, timeout_s: float = 20.0) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    sock.settimeout(timeout_s)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def _status_and_json(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_slow_heads_and_bodies_get_408_and_are_closed(engine, gateway_process):
    gateway = gateway_process("--engine", engine.url, "--header-timeout-s", "1", "--body-timeout-s", "1")
    conns = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(12)]
    try:
        for i, s in enumerate(conns[:8]):  # 8 slow heads (half a request line, or nothing at all)
            if i % 2:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for s in conns[8:]:  # 4 slow bodies: 10 of the 100 bytes announced
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\": ")
        for i, s in enumerate(conns):
            status, body = _status_and_json(_read_until_closed(s))
            assert status == 408, (i, body)
            assert "--header-timeout-s" in body["error"]["message"] if i < 8 else "--body-timeout-s" in \
                body["error"]["message"]
    finally:
        for s in conns:
            s.close()
    r = httpx.post(gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text  # a client that sends at a normal pace is served


def test_connections_past_the_cap_get_a_json_503(engine, gateway_process):
    gateway = gateway_process("--engine", engine.url, "--max-connections", "6", "--header-timeout-s", "60")
    idle = [socket.create_connection(("127.0.0.1", gateway.port)) for _ in range(8)]
    try:
        time.sleep(0.5)  # the server has accepted them
        r = httpx.get(gateway.url + "/v1/models", timeout=30)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable" and "--max-connections" in r.text
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 30
    while (r := httpx.get(gateway.url + "/v1/models", timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.2)


def test_health_answers_from_its_cache_while_the_engine_is_frozen(engine_process, gateway_process):
    engine = engine_process("--model", "demo", "--max-seq-len", "256")
    gateway = gateway_process("--engine", engine.url, "--health-interval-s", "0.5")
    os.killpg(engine.proc.pid, signal.SIGSTOP)  # alive, accepting connections, answering nothing
    try:
        for _ in range(10):  # unauthenticated and frequent: each must not cost an engine call
            r = httpx.get(gateway.url + "/health", timeout=3)  # the engine client's own timeout is 10 s
            assert r.status_code in (200, 503) and r.json()["engines"], r.text
    finally:
        os.killpg(engine.proc.pid, signal.SIGCONT)
    gateway.wait_healthy(60)


def _stream(url: str, body: dict, out: dict) -> None:
    """Read an SSE completion to its end: every data line in out["events"], out["error"] on a broken
    connection (what a client sees when the server cuts a stream)."""
    out["events"] = []
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def _post(url: str, body: dict, out: dict) -> None:
    try:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        out["status"], out["headers"], out["text"] = r.status_code, r.headers, r.text
    except httpx.HTTPError as exc:
        out["error"] = repr(exc)


def test_sigterm_drains_then_ends_each_request_readably(engine, gateway_process):
    """uvicorn's 2 s graceful timeout used to cut streams with no [DONE] and answer plain-text 500s."""
    # The grace must outlast `short` (4 tokens) and not `endless`: the demo decodes ~500 tok/s on an idle 2-core
    # machine, so 4000 tokens take ~8 s there, and a loaded machine slows both alike.
    gateway = gateway_process("--engine", engine.url, "--shutdown-grace-s", "4")
    endless = {"model": MODEL, "prompt": "Tell me everything", "max_tokens": 4000, "temperature": 0,
               "ignore_eos": True}
    short = {**endless, "max_tokens": 4}
    results = {name: {} for name in ("stream", "json", "short")}
    threads = [threading.Thread(target=_stream, args=(gateway.url, endless, results["stream"])),
               threading.Thread(target=_post, args=(gateway.url, endless, results["json"]))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(results["stream"].get("events", [])) < 3:  # both are running on the engine
        assert time.monotonic() < deadline, results
        time.sleep(0.1)
    threads.append(threading.Thread(target=_stream, args=(gateway.url, short, results["short"])))
    threads[-1].start()
    time.sleep(0.5)
    gateway.proc.send_signal(signal.SIGTERM)
    at_signal = len(results["stream"]["events"])
    for t in threads:
        t.join(90)
    # uvicorn re-raises the signal it handled once it has shut down: exit by SIGTERM, no traceback
    assert gateway.proc.wait(30) in (0, -signal.SIGTERM) and "Traceback" not in gateway.log_tail(), \
        gateway.log_tail()

    short_events = results["short"]["events"]  # finished within the grace, as if nothing happened
    assert short_events[-1] == "[DONE]", short_events
    assert json.loads(short_events[-2]).get("choices", [{}])[0].get("finish_reason") == "length", short_events

    stream = results["stream"]  # still running when the grace ended: an error event, then [DONE]
    assert "error" not in stream, stream.get("error")
    assert stream["events"][-1] == "[DONE]", stream["events"][-3:]
    error = json.loads(stream["events"][-2])["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert len(stream["events"]) > at_signal + 2  # it streamed on through the grace

    answer = results["json"]  # the non-streamed one: OpenAI's error JSON, not a plain-text 500
    assert answer.get("status") == 503, answer
    assert json.loads(answer["text"])["error"]["type"] == "service_unavailable"
    assert answer["headers"].get("retry-after")

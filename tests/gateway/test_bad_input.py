"""Hostile input against `tandem gateway` + `tandem engine` (issue 20): every malformed request gets a 4xx
with OpenAI's error body and the server keeps serving; client strings never become metric labels;
secrets never leave the process (--help, 503 bodies, logs; the example curl: tests/e2e/test_serve.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pytest

from benchmarks.server_process import free_port
from services.common.profiles import profile_filename

API_KEY = "sk-hardening-key-5f3a"
ADMIN = "admin-hardening-token-9c1e"
REDIS_PASSWORD = "redis-pw-7d2b-never-shown"
MODEL = "tandem-demo"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def profiles_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("bad-profiles")
    (d / profile_filename("GPU-deep")).write_text("[" * 100_000 + "]" * 100_000)
    (d / profile_filename("GPU-digits")).write_text('{"schema_version": 1, "c_sync_s": ' + "9" * 5000 + "}")
    return d


@pytest.fixture(scope="module")
def stack(engine_process, gateway_process, profiles_dir):
    engine = engine_process("--model", "demo", "--max-seq-len", "512", "--max-running-requests", "4")
    closed = free_port()  # nothing listens there: the job queue is down
    gateway = gateway_process("--engine", engine.url, "--api-key", API_KEY, "--admin-token", ADMIN,
                              "--redis-url", f"redis://:{REDIS_PASSWORD}@127.0.0.1:{closed}/0",
                              "--profiles-dir", str(profiles_dir), "--health-interval-s", "0.5")
    return engine, gateway


def _raw(text: str) -> bytes:
    """A JSON body written by hand (json.dumps cannot write a lone surrogate escape on purpose)."""
    return text.encode()


def _deep(depth: int) -> bytes:
    return b'{"model": "tandem-demo", "messages": ' + b"[" * depth + b"]" * depth + b"}"


ADMIN_PROFILES = "/admin/profiles"
BAD = [
    # item 7: lone surrogates ("\ud800" escapes decode to text no encoder accepts)
    ("surrogate in content", "/v1/chat/completions",
     _raw('{"model": "tandem-demo", "messages": [{"role": "user", "content": "a\\ud800b"}]}'), 400),
    ("surrogate in prompt", "/v1/completions", _raw('{"model": "tandem-demo", "prompt": "x\\udfff"}'), 400),
    ("surrogate in stop", "/v1/completions", _raw('{"model": "tandem-demo", "prompt": "x", "stop": ["\\ud83d"]}'), 400),
    ("surrogate in model", "/v1/chat/completions",
     _raw('{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'), 400),
    # item 7: chat_template_kwargs naming the template's own arguments
    *[(f"chat_template_kwargs.{k}", "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {k: v}}, 400)
      for k, v in [("add_generation_prompt", False), ("tools", []), ("messages", [])]],
    # the same two on /tokenize, which templates and tokenizes too
    ("surrogate in /tokenize prompt", "/tokenize", _raw('{"prompt": "a\\ud800"}'), 400),
    ("chat_template_kwargs.add_generation_prompt on /tokenize", "/tokenize",
     {"messages": CHAT["messages"], "chat_template_kwargs": {"add_generation_prompt": False}}, 400),
    # item 7: admin bodies that are not a JSON object
    ("admin body is an array", ADMIN_PROFILES, _raw('["-o", "/etc/passwd"]'), 400),
    ("admin body nested deeply", ADMIN_PROFILES, b"[" * 100_000 + b"]" * 100_000, 400),
    ("admin body 5000 digits", ADMIN_PROFILES, _raw('{"kind": ' + "9" * 5000 + "}"), 400),
    # the same parser limits on /v1
    ("chat body nested deeply", "/v1/chat/completions", _deep(100_000), 400),
    ("chat max_tokens 5000 digits", "/v1/chat/completions",
     _raw('{"model": "tandem-demo", "messages": [], "max_tokens": ' + "9" * 5000 + "}"), 400),
    ("body not UTF-8", "/v1/chat/completions", b'{"model": "tandem-demo\xff\xfe", "messages": []}', 400),
    # item 1: a prompt longer than the context can hold is refused before it is tokenized
    ("3.9 MB chat content", "/v1/chat/completions",
     {**CHAT, "messages": [{"role": "user", "content": "The quick brown fox. " * 185_000}]}, 400),
    ("long completion prompt", "/v1/completions", {"model": MODEL, "prompt": "word " * 20_000}, 400),
    # body over --max-body-bytes sent chunked (no Content-Length to check up front)
    ("chunked body over the limit", "/v1/chat/completions", iter([b"{" + b" " * (1 << 20)] * 5), 413),
]


def _send(gateway, path: str, body) -> httpx.Response:
    key = ADMIN if path.startswith("/admin") else API_KEY
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    return httpx.post(gateway.url + path, content=body, headers=headers, timeout=60)


def _serves(gateway) -> None:
    health = httpx.get(gateway.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    ok = _send(gateway, "/v1/chat/completions", CHAT)
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("name,path,body,status", BAD, ids=[c[0] for c in BAD])
def test_bad_input_gets_an_openai_4xx_and_the_server_keeps_serving(stack, name, path, body, status):
    gateway = stack[1]
    r = _send(gateway, path, body)
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if name in ("3.9 MB chat content", "long completion prompt"):
        assert "512 tokens" in err["message"] and "characters" in err["message"], err
    if name.startswith("chat_template_kwargs"):
        assert err["param"] == "chat_template_kwargs" and name.split(".")[1].split()[0] in err["message"]
    _serves(gateway)


def _rss_mb(pid: int) -> float:
    return int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024


def test_a_huge_prompt_costs_no_memory_and_no_tokenizing(stack):
    """Issue 20 item 1: a 3.9 MB chat took the gateway from 70 to 950 MB for good (tokenized on the loop)."""
    gateway = stack[1]
    _serves(gateway)
    before = _rss_mb(gateway.proc.pid)
    body = {**CHAT, "messages": [{"role": "user", "content": "The quick brown fox. " * 185_000}]}
    for _ in range(3):
        assert _send(gateway, "/v1/chat/completions", body).status_code == 400
    grown = _rss_mb(gateway.proc.pid) - before
    assert grown < 100, f"gateway RSS grew by {grown:.0f} MB over three 3.9 MB prompts"
    _serves(gateway)


def test_model_label_only_for_served_models(stack):
    """Issue 20 item 2: the request's `model` string became a label before validation (3000 random names
    made 8.7 MB of /metrics)."""
    gateway = stack[1]
    names = [f"no-such-model-{uuid.uuid4().hex[:12]}" for _ in range(30)]
    for name in names:
        assert _send(gateway, "/v1/chat/completions", {**CHAT, "model": name}).status_code == 404
    _serves(gateway)
    text = httpx.get(gateway.url + "/metrics", timeout=10).text
    assert not [n for n in names if n in text]
    assert f'model_name="{MODEL}"' in text  # the served model still labels its requests


def test_admin_503_and_logs_do_not_show_the_redis_password(stack):
    gateway = stack[1]
    r = _send(gateway, ADMIN_PROFILES, {"kind": "bw"})
    assert r.status_code == 503, r.text
    assert REDIS_PASSWORD not in r.text and "***" in r.json()["error"]["message"]
    assert REDIS_PASSWORD not in gateway.log_tail(400)


def test_bad_profile_files_are_listed_as_invalid(stack):
    r = httpx.get(stack[1].url + ADMIN_PROFILES, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    entries = {e["file"]: e for e in r.json()["data"]}
    assert len(entries) == 2 and not any(e["valid"] for e in entries.values())
    assert "RecursionError" in entries[profile_filename("GPU-deep")]["error"]
    assert "4300 digits" in entries[profile_filename("GPU-digits")]["error"]


@pytest.mark.parametrize("command", ["gateway", "serve"])
def test_help_never_prints_a_secret(command):
    env = dict(os.environ, TANDEM_API_KEYS=API_KEY, TANDEM_ADMIN_TOKEN=ADMIN,
               TANDEM_REDIS_URL=f"redis://:{REDIS_PASSWORD}@127.0.0.1:6379/0", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "services.cli", command, "--help"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "--api-key" in out.stdout and "(default: set)" in out.stdout
    for secret in (API_KEY, ADMIN, REDIS_PASSWORD):
        assert secret not in out.stdout + out.stderr

"""The real `openai` client against `tandem gateway` + `tandem engine`, separate processes over HTTP
(demo model). Invariants follow llama.cpp's server tests; identical concurrent outputs follow TGI's."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from services.common.chat_template import render_chat
from services.common.tokenizer import Tokenizer
from services.engine.runtime.kv_cache import BLOCK_SIZE

API_KEY = "sk-test-key"
MODEL = "tandem-demo"
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]


@pytest.fixture(scope="module")
def stack(engine_process, gateway_process):
    engine = engine_process("--model", "demo", "--max-seq-len", "512", "--max-running-requests", "4",
                            "--max-waiting-requests", "32")
    gateway = gateway_process("--engine", engine.url, "--api-key", API_KEY, "--max-body-bytes", "65536",
                              "--health-interval-s", "0.5")
    return engine, gateway


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1].url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(stack, demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def _chat_prompt_tokens(tokenizer: Tokenizer, messages) -> int:
    return len(tokenizer.encode(render_chat(tokenizer.tokenizer_config, messages, add_generation_prompt=True)))


def test_models_lists_the_engine_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_non_streaming_usage_matches_tokenizer(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.prompt_tokens == _chat_prompt_tokens(tokenizer, MESSAGES)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_invariants(client, tokenizer):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    choice_chunks = [c for c in chunks if c.choices]
    assert choice_chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    assert all(c.choices[0].finish_reason is None for c in choice_chunks[:-1])
    assert choice_chunks[-1].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage is not None
    assert usage.prompt_tokens == _chat_prompt_tokens(tokenizer, MESSAGES) and usage.completion_tokens == 10
    text = "".join(c.choices[0].delta.content or "" for c in choice_chunks)
    assert text == full.choices[0].message.content  # greedy: streaming == non-streaming


def test_completions_streaming_and_not(client, tokenizer):
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == r.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_text(client, stream):
    prompt = "Once upon a time"
    base = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 12, base
    stop = base[6:9]
    expected = base[:base.index(stop)]
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(**kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == expected and stop not in text
    assert finish == "stop"


def test_seed_reproducible_over_http(client):
    def sample(seed):
        return client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b, c = sample(123), sample(123), sample(456)
    assert a == b
    assert a != c


def test_concurrent_greedy_streams_are_identical(stack):
    lone = openai.OpenAI(base_url=stack[1].url + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    expected = lone.choices[0].message.content

    async def run():
        aclient = openai.AsyncOpenAI(base_url=stack[1].url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)

        async def one():
            stream = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=16,
                                                           temperature=0, stream=True,
                                                           extra_body={"ignore_eos": True})
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one() for _ in range(16)))
        finally:
            await aclient.close()

    outputs = asyncio.run(run())
    assert outputs == [expected] * 16


def _engine_stats(engine) -> dict:
    return httpx.get(engine.url + "/engine/v1/stats", timeout=10).json()


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_frees_the_slot(stack, stream):
    engine, gateway = stack
    aborted_before = _engine_stats(engine)["requests_aborted"]
    body = {"model": MODEL, "prompt": "A long story", "max_tokens": 500, "temperature": 0, "stream": stream,
            "ignore_eos": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if stream:
        with httpx.stream("POST", gateway.url + "/v1/completions", json=body, timeout=60, headers=headers) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few chunks: the request is running on the engine
            assert any(line.startswith("data: ") for line in got)
            assert _engine_stats(engine)["running"] >= 1
    else:  # the client gives up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(gateway.url + "/v1/completions", json=body, headers=headers, timeout=httpx.Timeout(10, read=0.3))
        assert _engine_stats(engine)["running"] >= 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stats = _engine_stats(engine)
        if stats["running"] == 0 and stats["kv_slots_used"] == 0:
            break
        time.sleep(0.2)
    assert stats["running"] == 0 and stats["kv_slots_used"] == 0, stats
    assert stats["requests_aborted"] == aborted_before + 1, stats


def _post(gateway, path: str, *, json_body=None, content=None, key: str | None = API_KEY, headers=None):
    h = {"Content-Type": "application/json", **(headers or {})}
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    return httpx.post(gateway.url + path, json=json_body, content=content, headers=h, timeout=60)


CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4}
INVALID = [
    ("bad JSON", "/v1/chat/completions", {"content": b'{"model": "tandem-demo", "messages": ['}, 400),
    ("wrong type", "/v1/chat/completions", {"json_body": {**CHAT, "max_tokens": "many"}}, 400),
    ("messages not a list", "/v1/chat/completions", {"json_body": {**CHAT, "messages": "hi"}}, 400),
    ("unknown model", "/v1/chat/completions", {"json_body": {**CHAT, "model": "no-such-model"}}, 404),
    ("too many tokens", "/v1/chat/completions", {"json_body": {**CHAT, "max_tokens": 100000}}, 400),
    ("negative temperature", "/v1/chat/completions", {"json_body": {**CHAT, "temperature": -1}}, 400),
    ("top_p above 1", "/v1/completions", {"json_body": {"model": MODEL, "prompt": "x", "top_p": 1.5}}, 400),
    ("empty messages", "/v1/chat/completions", {"json_body": {**CHAT, "messages": []}}, 400),
    ("refused field", "/v1/chat/completions", {"json_body": {**CHAT, "store": True}}, 400),
    ("unknown field", "/v1/chat/completions", {"json_body": {**CHAT, "temprature": 1}}, 400),
    ("empty prompt", "/v1/completions", {"json_body": {"model": MODEL, "prompt": ""}}, 400),
    ("missing key", "/v1/chat/completions", {"json_body": CHAT, "key": None}, 401),
    ("wrong key", "/v1/chat/completions", {"json_body": CHAT, "key": "sk-wrong"}, 401),
    ("oversized body", "/v1/chat/completions",
     {"json_body": {**CHAT, "messages": [{"role": "user", "content": "x" * 100_000}]}}, 413),
    ("unknown route", "/v1/nothing-here", {"json_body": CHAT}, 404),
]


@pytest.mark.parametrize("name,path,kwargs,status", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_requests_get_openai_errors(stack, name, path, kwargs, status):
    gateway = stack[1]
    r = _post(gateway, path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"], err
    if name == "too many tokens":
        assert "512" in err["message"]  # names the limit
    health = httpx.get(gateway.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    ok = _post(gateway, "/v1/chat/completions", json_body=CHAT)
    assert ok.status_code == 200, ok.text


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=-0.5)
    bad = openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model=MODEL, messages=MESSAGES)


def test_metrics_exposed(stack):
    engine, gateway = stack
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    assert "tandem_generation_tokens_total" in text and "tandem_num_requests_running" in text
    assert "tandem_gateway_requests_total" in httpx.get(gateway.url + "/metrics", timeout=10).text


def test_engine_info_and_health_contract(stack):
    engine = stack[0]
    info = httpx.get(engine.url + "/engine/v1/info", timeout=10).json()
    assert info["api_version"] == "v1" and info["model_id"] == MODEL and info["max_seq_len"] == 512
    assert info["eos_token_ids"] and json.loads(info["tokenizer_json"])
    health = httpx.get(engine.url + "/health", timeout=10).json()
    assert health["status"] == "ok" and health["maintenance"] == "serving"


def test_engine_generate_contract(stack):
    engine = stack[0]
    url = engine.url + "/engine/v1/generate"
    body = {"request_id": "direct-1", "prompt_token_ids": [5, 6, 7],
            "sampling": {"max_tokens": 5, "temperature": 0, "ignore_eos": True}}
    with httpx.stream("POST", url, json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert sum(len(x["token_ids"]) for x in lines) == 5
    assert [x["finish_reason"] for x in lines][-1] == "length" and lines[-1]["completion_tokens"] == 5
    assert all(x["finish_reason"] is None for x in lines[:-1]) and lines[-1]["prompt_tokens"] == 3
    for bad, status in [({**body, "prompt_token_ids": "abc"}, 400), ({**body, "sampling": {"temprature": 1}}, 400),
                        ({**body, "sampling": {"max_tokens": 600}}, 400), ({**body, "prompt_token_ids": []}, 400),
                        ({**body, "prompt_token_ids": [10**9]}, 400)]:
        r = httpx.post(url, json=bad, timeout=30)
        assert r.status_code == status and r.json()["error"]["message"], r.text
    r = httpx.post(url, content=b"{oops", timeout=30)
    assert r.status_code == 400
    too_long = httpx.post(url, json={**body, "sampling": {"max_tokens": 600}}, timeout=30).json()
    assert "--max-seq-len 512" in too_long["error"]["message"]


def test_next_chat_turn_reports_its_cached_prefix(client):
    """The second turn repeats the first turn's prompt and answer: the engine's prefix cache holds all of it
    but the answer's last token (never fed), in whole blocks of 16 tokens, and usage says so, as OpenAI's
    prompt_tokens_details does."""
    first = [{"role": "user", "content": "Name three lighthouse keepers of legend, please."}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=6, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "And one more?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=6, temperature=0)
    assert r1.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens
    whole_blocks = r1.usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    assert 0 < whole_blocks <= r2.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens

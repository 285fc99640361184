"""`tandem serve` (gateway + engine in one process, in-process engine client) with the real openai client."""

from __future__ import annotations

import openai


def test_serve_answers_chat_and_completions_and_prints_curl(serve_process):
    server = serve_process("--model", "demo", "--max-seq-len", "256", "--api-key", "sk-serve")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-serve", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    log = server.log_tail(200)
    assert f"curl http://127.0.0.1:{server.port}/v1/chat/completions" in log and "Bearer $OPENAI_API_KEY" in log
    assert "sk-serve" not in log  # the key itself is never printed (issue 20: logs and terminals are shared)


def test_serve_exposes_engine_stats_behind_the_api_key(serve_process):
    import httpx

    server = serve_process("--model", "demo", "--max-seq-len", "128", "--api-key", "sk-2")
    assert httpx.get(server.url + "/engine/v1/stats", timeout=10).status_code == 401
    stats = httpx.get(server.url + "/engine/v1/stats", headers={"Authorization": "Bearer sk-2"}, timeout=10).json()
    assert stats["moe_backend"] == "resident" and stats["kv_slots_total"] == 8 and isinstance(stats["experts"], dict)
    info = httpx.get(server.url + "/engine/v1/info", headers={"Authorization": "Bearer sk-2"}, timeout=10).json()
    assert info["model_id"] == "tandem-demo" and info["max_seq_len"] == 128
    assert "tandem_num_requests_running" in httpx.get(server.url + "/metrics", timeout=10).text

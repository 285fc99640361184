"""Streamed requests to one `tandem serve` gateway, as both modes of benchmarks/bench_serving.py send them:
the request bodies (greedy, exactly N tokens, ignore_eos) and one stream read into its timings, text and usage."""

from __future__ import annotations

import json
import time

import httpx


def chat_body(model: str, prompt: str, tokens: int) -> dict:
    """A streamed greedy chat completion of exactly ``tokens`` tokens."""
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}  # extension: exactly `tokens` decode steps


def completion_body(model: str, prompt_ids: list[int], tokens: int) -> dict:
    """A streamed greedy completion of exactly ``tokens`` tokens after the token ids ``prompt_ids``."""
    # logprobs 0: every token its own event. The detokenizer holds back a token that ends mid-character
    # (random-weight models emit many), which would put the first text event a decode step after the
    # first token; the logprob entries cost one [1, V] log_softmax per step.
    return {"model": model, "prompt": prompt_ids, "max_tokens": tokens, "temperature": 0.0, "logprobs": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}


async def stream_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, tokens: int) -> dict:
    """One streamed greedy chat completion; its timings, text and usage (or its error)."""
    return await stream_events(client, f"{url}/v1/chat/completions", chat_body(model, prompt, tokens))


async def stream_events(client: httpx.AsyncClient, endpoint: str, body: dict,
                        events: list[float] | None = None) -> dict:
    """POST a streamed chat or text completion; its timings (s), text and usage, or {"error": ...} (an HTTP
    status, an error event, a stream without usage). Each event (a chunk with content or a logprob
    entry) appends its perf_counter time to ``events`` as it arrives, so a caller can watch a stream live."""
    events = [] if events is None else events
    text, usage = [], None
    t_sent = time.perf_counter()
    try:
        async with client.stream("POST", endpoint, json=body) as resp:
            if resp.status_code != 200:
                return {"error": f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": f"error event: {json.dumps(chunk['error'])[:200]}"}
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    content = choice.get("text") or choice.get("delta", {}).get("content")
                    if content or choice.get("logprobs"):
                        events.append(time.perf_counter())
                        text.append(content or "")
    except httpx.HTTPError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if usage is None or not events:
        return {"error": f"stream ended early: {len(events)} events, usage={usage}"}
    n = usage["completion_tokens"]
    return {"sent_at": t_sent, "ttft_s": events[0] - t_sent, "itl_s": [b - a for a, b in zip(events, events[1:])],
            "stream_tok_s": (n - 1) / (events[-1] - events[0]) if len(events) > 1 else None,
            "tokens": n, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), "text": "".join(text)}

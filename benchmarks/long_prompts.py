"""The long-prompt mode of benchmarks/bench_serving.py, ``--prompt-tokens 2048,8192,32768`` (replaces its chat
levels): long prompts the way a user feels them. Per server and prompt length L, ``--repeats`` streamed greedy
``/v1/completions`` whose prompt is exactly L token ids (seeded random ids of the tokenizer's base vocabulary, no
special tokens; the first id differs between any two requests of a server, so none finds another's blocks in the
prefix cache), ``--output-tokens`` each (ignore_eos), after one unmeasured 512-token warm-up per server. Per row
(the median over the repeats): TTFT, prefill tok/s = L / TTFT, decode tok/s = (tokens - 1) / (last event
- first event), and the engine's preemptions over the row. ``--background-streams S`` first starts S
streamed chat completions of the short chat prompts, each up to 10,000 tokens, and sends the long prompt
once all S decode; they are cancelled when it ends. Their ITL p50 / p99 over the long prompt's prefill
(every gap that overlaps its send-to-first-token window: a stall shows as one long gap) and their ITL p99
before it (the baseline) go in the row: "ITL p99 of 15 running streams while a 32k prompt arrives".
The server keeps the model's trained context as its --max-seq-len (``--server-arg`` can set another).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time

import httpx

from benchmarks.serving_requests import chat_body, completion_body, stream_events
from benchmarks.stats import percentile

WARMUP_PROMPT_TOKENS = 512  # the unmeasured first request of each server
BACKGROUND_TOKENS = 10_000  # each background stream's length: longer than any long prompt's prefill lasts
BASELINE_GAPS = 16  # ITL gaps each background stream decodes, all of them running, before the long prompt
CHAT_PROMPTS_PER_STREAM = 4  # a background stream that ends starts again on its next prompt


def ordinary_token_ids(info: dict) -> list[int]:
    """The ids a prompt may use (GET /engine/v1/info): the tokenizer's base vocabulary without its added
    tokens (the special ones: BOS/EOS, the chat template's markers)."""
    tokenizer = json.loads(info["tokenizer_json"])
    vocab = tokenizer["model"]["vocab"]  # {token: id} (BPE, WordPiece) or [[token, score], ...] (Unigram)
    ids = set(vocab.values()) if isinstance(vocab, dict) else set(range(len(vocab)))
    return sorted(ids - {t["id"] for t in tokenizer.get("added_tokens", [])})


def token_prompt(ordinary: list[int], length: int, index: int, seed: int) -> list[int]:
    """``length`` seeded random ids of ``ordinary``; the first is ordinary[index], so prompts of distinct
    ``index`` share no prefix-cache block."""
    rng = random.Random(f"{seed}:{length}:{index}")
    return [ordinary[index % len(ordinary)], *rng.choices(ordinary, k=length - 1)]


async def keep_streaming(client: httpx.AsyncClient, url: str, model: str, prompts: list[str], tokens: int,
                         requests: list[list[float]], errors: list[str]) -> None:
    """Stream chat completions of ``prompts`` in turn, the next as soon as one ends, until cancelled or one
    fails (its error goes to ``errors``); each request's event times go to a new list of ``requests``."""
    for prompt in itertools.cycle(prompts):
        requests.append([])
        result = await stream_events(client, f"{url}/v1/chat/completions", chat_body(model, prompt, tokens),
                                     requests[-1])
        if "error" in result:
            errors.append(result["error"])
            return


async def all_decoding(streams: list[list[list[float]]], tasks: list[asyncio.Task]) -> float:
    """Wait until every background stream has BASELINE_GAPS gaps after the moment the last of them started
    (or one has stopped); that moment (perf_counter s), the start of the baseline window."""
    while True:
        firsts = [s[0][0] for s in streams if s and s[0]]
        steady = max(firsts, default=time.perf_counter())
        if any(task.done() for task in tasks) or (len(firsts) == len(streams) and all(
                sum(t > steady for request in s for t in request) >= BASELINE_GAPS for s in streams)):
            return steady
        await asyncio.sleep(0.01)


async def long_prompt_request(url: str, model: str, prompt_ids: list[int], tokens: int, background: list[list[str]],
                              background_tokens: int) -> dict:
    """One streamed completion of ``prompt_ids``, sent once len(``background``) chat streams (each cycling
    through its prompts, ``background_tokens`` long) all decode, which are cancelled when it ends. Its
    stream_events result, with "background_errors" and, given background streams, their ITL gaps (s)
    before its send ("bg_itl_before_s") and overlapping its send-to-first-token window ("bg_itl_during_s")."""
    streams: list[list[list[float]]] = [[] for _ in background]  # stream -> request -> event times
    errors: list[str] = []
    # no read timeout worth the name: a 32k prompt on the CPU backend prefills for minutes before its first event
    timeout, limits = httpx.Timeout(3600.0, connect=10.0), httpx.Limits(max_connections=len(background) + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        tasks = [asyncio.create_task(keep_streaming(client, url, model, prompts, background_tokens, s, errors))
                 for prompts, s in zip(background, streams)]
        try:
            steady = await all_decoding(streams, tasks)
            result = await stream_events(client, f"{url}/v1/completions", completion_body(model, prompt_ids, tokens))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    if "error" not in result and result["prompt_tokens"] != len(prompt_ids):
        result = {"error": f"usage reports {result['prompt_tokens']} prompt tokens, {len(prompt_ids)} were sent"}
    if "error" in result or not background:
        return {**result, "background_errors": errors}
    sent, first = result["sent_at"], result["sent_at"] + result["ttft_s"]
    gaps = [(a, b) for s in streams for request in s for a, b in zip(request, request[1:])]
    return {**result, "background_errors": errors,
            "bg_itl_before_s": [b - a for a, b in gaps if steady <= a and b <= sent],
            "bg_itl_during_s": [b - a for a, b in gaps if b > sent and a < first]}  # a stall: one long gap


def summarize_long_prompt(length: int, results: list[dict], background_streams: int) -> dict:
    """One prompt length's row from its repeats: the medians of TTFT and decode tok/s, prefill tok/s = length
    / that TTFT, and with background streams their ITL (ms) pooled over the repeats."""
    ok = [r for r in results if "error" not in r]
    ttft = statistics.median(r["ttft_s"] for r in ok) if ok else None
    decode = [r["stream_tok_s"] for r in ok if r["stream_tok_s"]]
    row = {"mode": "long_prompt", "prompt_tokens": length,
           "usage_prompt_tokens": max((r["prompt_tokens"] for r in ok), default=None),  # what usage reported
           "ttft_s": ttft, "prefill_tok_s": length / ttft if ttft else None,
           "decode_tok_s": statistics.median(decode) if decode else None,
           "repeats": len(results), "errors": len(results) - len(ok),
           "first_error": next((r["error"] for r in results if "error" in r), None),
           "cached_tokens": max((r["cached_tokens"] for r in ok), default=None),  # 0: no prefix-cache help
           "background_streams": background_streams}
    if background_streams:
        during = [gap * 1e3 for r in ok for gap in r["bg_itl_during_s"]]
        before = [gap * 1e3 for r in ok for gap in r["bg_itl_before_s"]]
        errors = [e for r in results for e in r.get("background_errors", [])]
        row.update({"bg_itl_ms_p50": percentile(during, 50), "bg_itl_ms_p99": percentile(during, 99),
                    "bg_itl_gaps": len(during), "bg_itl_ms_p99_before": percentile(before, 99),
                    "background_errors": len(errors), "first_background_error": errors[0] if errors else None})
    return row


def measure_long_prompts(args: argparse.Namespace, url: str, model: str):
    """The long-prompt mode on a started server: a row per --prompt-tokens length (module docstring)."""
    info = httpx.get(f"{url}/engine/v1/info", timeout=30).json()
    ordinary = ordinary_token_ids(info)
    background_tokens = min(BACKGROUND_TOKENS, info["max_seq_len"] - args.max_prompt_tokens)
    streams = args.background_streams
    background = [args.prompts[i::streams] for i in range(streams)]  # distinct prompts, distinct experts
    asyncio.run(long_prompt_request(url, model, token_prompt(ordinary, WARMUP_PROMPT_TOKENS, 0, args.seed),
                                    args.output_tokens, [], background_tokens))
    index = 1  # the warm-up's was 0: each request its own first token
    for length in args.prompt_tokens_list:
        results, preemptions = [], 0
        for _ in range(args.repeats):
            before = httpx.get(f"{url}/engine/v1/stats", timeout=30).json()
            results.append(asyncio.run(long_prompt_request(url, model, token_prompt(ordinary, length, index, args.seed),
                                                           args.output_tokens, background, background_tokens)))
            after = httpx.get(f"{url}/engine/v1/stats", timeout=30).json()
            preemptions += after.get("preemptions", 0) - before.get("preemptions", 0)
            index += 1
        vram = after.get("vram") or {}  # the engine's peak since it started (CUDA): what --gpu-memory-limit bounds
        yield {**summarize_long_prompt(length, results, streams), "preemptions": preemptions,
               "peak_allocated_gib": vram["peak_allocated_bytes"] / 2 ** 30 if "peak_allocated_bytes" in vram else None,
               "kv_cache": after.get("kv_cache")}

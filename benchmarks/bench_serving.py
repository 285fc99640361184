"""Serving under many clients, the way the field measures it (vLLM's benchmark_serving, SGLang's
bench_serving): distinct prompts streamed through the real gateway of one `tandem serve` per backend
and share of experts cached.

Prompts: ``benchmarks/chat_prompts.py`` builds a reproducible set of distinct chat prompts (seeded; lengths
drawn uniformly from 30-100 tokens, the issue's "short chat turn"). Distinct prompts route to distinct
experts — identical prompts (the old version of this benchmark) share every expert and flatter the cache.

Two load modes, each a list of levels:
  --concurrency 1,2,4,8,16,32   at most C requests in flight; ``--num-prompts`` requests per level
                                (default max(8, 2C)), the next sent as soon as one ends
  --request-rate 1,4,16         Poisson arrivals at R requests/s (exponential gaps, seeded), no cap

Each request is a streamed greedy chat completion of exactly ``--output-tokens`` tokens (ignore_eos).
Each server first serves 4 warm-up requests at concurrency 4; ``--level-warmup K`` adds K x C unmeasured
requests before each concurrency level C (hybrid's split is tuned per batch size: ~250 steps of a size
before it rests, docs/serving.md), all on prompts outside the measured set.
Per level: total output tok/s (all tokens / wall time), per-stream decode tok/s ((tokens - 1) / (last
event - first event)), TTFT and ITL (the gap between two streamed content events; the detokenizer may
merge tokens into one event) at p50 and p99, requests/s, errors, the engine's expert miss rate over the
level, and ``matches_solo``: the share of requests whose greedy text equals the same prompt's text at
concurrency 1 (a request's output should not depend on its neighbours; see docs/serving.md).

    python -m benchmarks.bench_serving --model 'synthetic:qwen3-30b-a3b?layers=24' --device cuda \\
        --dtype bfloat16 --backend resident,offload,hybrid --cache-rate 0.33 \\
        --concurrency 1,2,4,8,16,32 --json serving.jsonl --plot serving.png

Long-prompt mode, ``--prompt-tokens`` (replaces the levels above): benchmarks/long_prompts.py says what it measures.

    python -m benchmarks.bench_serving --model 'synthetic:qwen3-30b-a3b?layers=24' --device cuda \\
        --dtype bfloat16 --backend resident,offload,hybrid --cache-rate 0.33 \\
        --prompt-tokens 2048,8192,32768 --output-tokens 64 --background-streams 15 \\
        --json long.jsonl --plot long.png
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.bench_decode_moe import _delta, engine_summary
from benchmarks.chat_prompts import SUBJECTS, TASKS, chat_prompts
from benchmarks.long_prompts import BACKGROUND_TOKENS, CHAT_PROMPTS_PER_STREAM, measure_long_prompts
from benchmarks.server_process import ServerProcess
from benchmarks.serving_requests import stream_request
from benchmarks.stats import percentile


async def run_level(url: str, model: str, prompts: list[str], tokens: int, concurrency: int | None,
                    rate: float | None, seed: int) -> tuple[list[dict], float]:
    """Send ``prompts`` (index order) with at most ``concurrency`` in flight, or as Poisson arrivals at
    ``rate``/s; the per-request results (in prompt order) and the level's wall time."""
    in_flight = asyncio.Semaphore(concurrency or len(prompts))
    gaps = random.Random(seed)
    limits = httpx.Limits(max_connections=(concurrency or len(prompts)) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        async def one(prompt: str) -> dict:
            async with in_flight:
                return await stream_request(client, url, model, prompt, tokens)

        t0 = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if rate:
                await asyncio.sleep(gaps.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def summarize_level(results: list[dict], wall_s: float, solo_texts: dict[int, str]) -> dict:
    ok = [r for r in results if "error" not in r]
    ttft = [r["ttft_s"] * 1e3 for r in ok]
    itl = [gap * 1e3 for r in ok for gap in r["itl_s"]]
    streams = [r["stream_tok_s"] for r in ok if r["stream_tok_s"]]
    compared = [i for i, r in enumerate(results) if "error" not in r and i in solo_texts]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "first_error": next((r["error"] for r in results if "error" in r), None),
        "wall_s": wall_s, "req_s": len(ok) / wall_s,
        "total_tok_s": sum(r["tokens"] for r in ok) / wall_s,
        "stream_tok_s_mean": statistics.fmean(streams) if streams else None,
        "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
        "itl_ms_p50": percentile(itl, 50), "itl_ms_p99": percentile(itl, 99),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
        "matches_solo": (sum(results[i]["text"] == solo_texts[i] for i in compared) / len(compared)
                         if compared else None),
    }


def server_args(args: argparse.Namespace, backend: str, cache_rate: float | None, max_running: int) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--moe-backend", backend,
           "--max-running-requests", str(max_running)]
    if not args.prompt_tokens_list:  # long prompts keep the model's trained context
        out += ["--max-seq-len", str(args.max_prompt_tokens + args.output_tokens)]
    if backend != "resident" and cache_rate is not None:
        out += ["--moe-cache-rate", str(cache_rate)]
    elif backend != "resident":
        out += ["--moe-cache-auto"]
    return out + args.server_arg


def prompts_per_level(args: argparse.Namespace, mode: str, level: float) -> int:
    """Requests sent at one level: --num-prompts, else max(8, 2C) at concurrency C and 32 at a rate."""
    if args.num_prompts:
        return args.num_prompts
    return max(8, 2 * int(level)) if mode == "concurrency" else 32


def levels(args: argparse.Namespace) -> list[tuple[str, float]]:
    """("concurrency", C) levels first (C=1 gives the solo texts), then ("rate", R) levels."""
    return [("concurrency", c) for c in args.concurrency_list] + [("rate", r) for r in args.rate_list]


def max_running_requests(args: argparse.Namespace) -> int:
    """The server's --max-running-requests: --max-running-requests, else room for the most streams at once."""
    most = args.background_streams + 1 if args.prompt_tokens_list else max(args.concurrency_list, default=1)
    return max(most, args.max_running_requests, 1)


def measure_levels(args: argparse.Namespace, url: str, model: str):
    """The chat-concurrency mode on a started server: a row per concurrency level and request rate."""
    # warm-up on prompts outside the measured set: caches and compiled shapes at their steady state
    asyncio.run(run_level(url, model, args.warmup_prompts[:4], args.output_tokens, 4, None, args.seed))
    solo_texts: dict[int, str] = {}
    for mode, level in levels(args):
        prompts = args.prompts[:prompts_per_level(args, mode, level)]
        warm = args.level_warmup * int(level) if mode == "concurrency" else 0
        if warm:  # this level's batch size at its steady state first (hybrid tunes its split per batch size)
            asyncio.run(run_level(url, model, args.warmup_prompts[:warm], args.output_tokens, int(level),
                                  None, args.seed))
        before = httpx.get(f"{url}/engine/v1/stats", timeout=30).json()
        results, wall = asyncio.run(run_level(url, model, prompts, args.output_tokens,
                                              int(level) if mode == "concurrency" else None,
                                              level if mode == "rate" else None, args.seed))
        after = httpx.get(f"{url}/engine/v1/stats", timeout=30).json()
        if mode == "concurrency" and level == 1:
            solo_texts = {i: r["text"] for i, r in enumerate(results) if "error" not in r}
        summary = engine_summary(_delta(before, after))
        yield {"mode": mode, mode: level, "level_warmup_requests": warm,
               **summarize_level(results, wall, solo_texts),
               "miss_rate": summary["miss_rate"], "fetch_share": summary["fetch_share"]}


def run_server(args: argparse.Namespace, backend: str, cache_rate: float | None) -> list[dict]:
    """One server, every level (or prompt length); a row each (a failed server gives one row with its error)."""
    max_running = max_running_requests(args)
    tag = f"{backend}" + (f"-{cache_rate}" if cache_rate is not None and backend != "resident" else "")
    server = ServerProcess(server_args(args, backend, cache_rate, max_running), args.log_dir / f"serve-{tag}.log")
    base = {"backend": backend, "cache_rate": None if backend == "resident" else cache_rate, "model": args.model,
            "device": args.device, "dtype": args.dtype, "output_tokens": args.output_tokens,
            "max_running_requests": max_running, "command": server.command}
    rows: list[dict] = []
    try:
        server.wait_ready(args.startup_timeout)
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        measure = measure_long_prompts if args.prompt_tokens_list else measure_levels
        for row in measure(args, server.url, model):
            rows.append({**base, **row, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                         "ok": True})
            record(args, rows[-1])
    except Exception as exc:  # one failing server must not stop the others
        rows.append({**base, "ok": False, "error": f"{type(exc).__name__}: {exc}", "log_tail": server.log_tail()})
        record(args, rows[-1])
    finally:
        server.stop(pause_s=2.0 if args.device == "cuda" else 0.0)
    return rows


# (row key, column width, format of a value); "level" is the row's concurrency or request rate
COLUMNS = [("backend", 9, "{}"), ("cache_rate", 5, "{}"), ("mode", 11, "{}"), ("level", 6, "{}"),
           ("total_tok_s", 9, "{:.1f}"), ("stream_tok_s_mean", 9, "{:.1f}"), ("ttft_ms_p50", 8, "{:.0f}"),
           ("ttft_ms_p99", 8, "{:.0f}"), ("itl_ms_p50", 7, "{:.1f}"), ("itl_ms_p99", 7, "{:.1f}"),
           ("req_s", 6, "{:.2f}"), ("errors", 6, "{}"), ("miss_rate", 6, "{:.3f}"), ("matches_solo", 6, "{:.2f}")]
# the long-prompt mode's columns: background ITL before the long prompt ("bef") and over its prefill ("dur")
LONG_COLUMNS = [("backend", 9, "{}"), ("cache_rate", 5, "{}"), ("prompt_tokens", 7, "{}"), ("ttft_s", 8, "{:.3f}"),
                ("prefill_tok_s", 9, "{:.0f}"), ("decode_tok_s", 8, "{:.1f}"), ("bg_itl_ms_p99_before", 9, "{:.1f}"),
                ("bg_itl_ms_p50", 9, "{:.1f}"), ("bg_itl_ms_p99", 9, "{:.1f}"), ("preemptions", 7, "{}"),
                ("cached_tokens", 6, "{}"), ("errors", 6, "{}")]
LABELS = {"prompt_tokens": "prompt", "prefill_tok_s": "prefill/s", "decode_tok_s": "decode/s",
          "bg_itl_ms_p99_before": "itl99 bef", "bg_itl_ms_p50": "itl50 dur", "bg_itl_ms_p99": "itl99 dur",
          "preemptions": "preempt", "cached_tokens": "cached"}


def columns(long_prompt: bool) -> list[tuple[str, int, str]]:
    return LONG_COLUMNS if long_prompt else COLUMNS


def table_header(long_prompt: bool) -> str:
    return " | ".join(LABELS.get(key, key)[:width].rjust(width) for key, width, _ in columns(long_prompt))


def table_line(row: dict) -> str:
    cells = []
    for key, width, fmt in columns(row["mode"] == "long_prompt"):
        value = row.get(row["mode"]) if key == "level" else row.get(key)
        cells.append((fmt.format(value) if value is not None else "-").rjust(width))
    return " | ".join(cells)


def record(args: argparse.Namespace, row: dict) -> None:
    """Print a row and append it to --json at once: a run cut short keeps what it measured."""
    if row["ok"]:
        print(table_line(row), flush=True)
        for key in ("first_error", "first_background_error"):
            if row.get(key):
                print(f"    {key}: {row[key][:200]}", flush=True)
    else:
        print(f"{row['backend']}: FAILED {row['error'][:200]}", flush=True)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


def series(rows: list[dict], mode: str, x: str) -> dict[str, list[dict]]:
    """The successful rows of ``mode``, one list per backend (and cache share), in order of ``x``."""
    lines: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("ok") and r.get("mode") == mode:
            label = r["backend"] + (f" {100 * r['cache_rate']:.0f} % cached" if r["cache_rate"] is not None else "")
            lines.setdefault(label, []).append(r)
    if not lines:
        raise ValueError(f"no successful {mode} rows to plot")
    return {label: sorted(rs, key=lambda r: r[x]) for label, rs in sorted(lines.items())}


def plot_rows(rows: list[dict], path: Path) -> Path:
    """Total tok/s and TTFT p50 against concurrency, one line per backend (and cache share); or in the
    long-prompt mode prefill tok/s and TTFT against the prompt's length."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    long_prompt = any(r.get("mode") == "long_prompt" for r in rows)
    if long_prompt:
        x, xlabel, panels = "prompt_tokens", "prompt tokens", (("prefill_tok_s", "prefill tok/s"), ("ttft_s", "TTFT (s)"))
    else:
        x, xlabel = "concurrency", "concurrent streams"
        panels = (("total_tok_s", "total output tok/s"), ("ttft_ms_p50", "TTFT p50 (ms)"))
    lines = series(rows, "long_prompt" if long_prompt else "concurrency", x)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (key, ylabel) in zip(axes, panels):
        for label, line in lines.items():
            points = [(r[x], r[key]) for r in line if r[key] is not None]  # a length that failed: no point
            ax.plot([px for px, _ in points], [py for _, py in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.suptitle(rows[0].get("model", ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_list(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo", help="what `tandem serve --model` takes (default: demo)")
    p.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default: bfloat16)")
    p.add_argument("--backend", default="resident,offload,hybrid",
                   help="comma-separated --moe-backend values, one server each (default: resident,offload,hybrid)")
    p.add_argument("--cache-rate", type=float, default=0.33,
                   help="share of experts cached for the non-resident backends (default: 0.33)")
    p.add_argument("--concurrency", default="1,2,4,8,16,32",
                   help="comma-separated in-flight caps, one level each ('' for none; default: 1,2,4,8,16,32)")
    p.add_argument("--request-rate", default="",
                   help="comma-separated Poisson arrival rates in requests/s, one level each (default: none)")
    p.add_argument("--num-prompts", type=int, default=0,
                   help="requests per level (default 0: max(8, 2C) at concurrency C, 32 at a request rate)")
    p.add_argument("--prompt-tokens", default="",
                   help="comma-separated prompt lengths in tokens, e.g. 2048,8192,32768: the long-prompt mode, a "
                        "row per length, instead of the concurrency and rate levels (default: none, the chat levels)")
    p.add_argument("--repeats", type=int, default=2,
                   help="long-prompt mode: measured requests per length, the row gives their median (default: 2)")
    p.add_argument("--background-streams", type=int, default=0,
                   help=f"long-prompt mode: short chat streams (up to {BACKGROUND_TOKENS:,} tokens, cancelled when the "
                        "long request ends) decoding when each long prompt is sent; the row gives their ITL before "
                        "and during its prefill (default: 0, the long prompt alone)")
    p.add_argument("--output-tokens", type=int, default=128,
                   help="tokens generated per request; in the long-prompt mode by each long request (default: 128)")
    p.add_argument("--max-prompt-tokens", type=int, default=512,
                   help="room for a chat prompt: in the chat levels the server's --max-seq-len is this + "
                        "--output-tokens; in the long-prompt mode the background streams stop this short of the "
                        "model's context (default: 512; the demo's tokenizer spends ~3x the tokens of a real one)")
    p.add_argument("--max-running-requests", type=int, default=0,
                   help="the server's --max-running-requests (default 0: the largest concurrency level, or "
                        "--background-streams + 1 in the long-prompt mode)")
    p.add_argument("--level-warmup", type=int, default=0,
                   help="before each concurrency level C, K x C unmeasured requests at concurrency C on prompts outside "
                        "the measured set, so the level is measured at its steady state: hybrid tunes its split per "
                        "batch size, ~250 steps of that size (default 0: one warm-up of 4 requests per server)")
    p.add_argument("--seed", type=int, default=0, help="prompt sets and Poisson gaps (default: 0)")
    p.add_argument("--startup-timeout", type=float, default=900, help="seconds to wait for each server (default: 900)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="an extra `tandem serve` flag (repeatable), e.g. "
                        "--server-arg=--gpu-memory-limit --server-arg=24")
    p.add_argument("--log-dir", type=Path, default=Path("runs/bench_serving"),
                   help="server logs (default: runs/bench_serving)")
    p.add_argument("--json", type=Path, help="write the rows as JSON lines to this file, each as it is measured")
    p.add_argument("--plot", type=Path, help="write tok/s and TTFT against concurrency to this PNG (long-prompt "
                                             "mode: prefill tok/s and TTFT against the prompt's length)")
    args = p.parse_args(argv)
    args.concurrency_list = parse_list(args.concurrency, int)
    args.rate_list = parse_list(args.request_rate, float)
    args.prompt_tokens_list = parse_list(args.prompt_tokens, int)
    long_prompt = bool(args.prompt_tokens_list)
    if long_prompt:
        if any(n < 1 for n in args.prompt_tokens_list) or args.repeats < 1 or args.background_streams < 0:
            p.error("prompt lengths and --repeats must be >= 1, --background-streams >= 0")
        streams = args.background_streams
        # each background stream its own prompts (a stream that ends starts again on its next one)
        args.prompts = chat_prompts(min(CHAT_PROMPTS_PER_STREAM * streams, len(TASKS) * len(SUBJECTS)), seed=args.seed)
        if streams > len(args.prompts):
            p.error(f"--background-streams: at most {len(args.prompts)} (one distinct chat prompt each)")
    else:
        if not args.concurrency_list and not args.rate_list:
            p.error("give at least one --concurrency or --request-rate level")
        if any(c < 1 for c in args.concurrency_list) or any(r <= 0 for r in args.rate_list):
            p.error("concurrency levels must be >= 1 and request rates > 0")
        if args.level_warmup < 0:
            p.error(f"--level-warmup must be 0 or positive, got {args.level_warmup}")
        most = max(prompts_per_level(args, mode, level) for mode, level in levels(args))
        warm = max(4, args.level_warmup * max(args.concurrency_list, default=0))  # distinct from the measured set
        everything = chat_prompts(most + warm, seed=args.seed)
        args.prompts, args.warmup_prompts = everything[:most], everything[most:]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text("")
    print(table_header(long_prompt), flush=True)
    rows: list[dict] = []
    for backend in parse_list(args.backend, str):
        rows += run_server(args, backend, None if backend == "resident" else args.cache_rate)
    if args.plot and any(r["ok"] for r in rows):
        plot_rows(rows, args.plot)
    return 0 if rows and all(r["ok"] and not r["errors"] and not r.get("background_errors") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Serving throughput under concurrency, with decode CUDA graphs on and off (the runner's A/B).

For each graphs setting: start `tandem serve` (its own process, TANDEM_CUDA_GRAPHS=1|0), then for each
concurrency C send C identical greedy streamed chat requests at once (ignore_eos: exactly D tokens
each). Per row: aggregate generated tok/s (all tokens / wall time), mean TTFT, mean per-stream decode
tok/s ((tokens - 1) / (last event - first event)), and whether all C outputs were identical (they must
be: greedy, batch-invariant scheduler).

    python benchmarks/bench_serving.py --model synthetic:qwen3-30b-a3b?layers=8 --device cuda \
        --dtype bfloat16 --concurrency 1,4,8 --decode-tokens 128 --json runs/serving.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from benchmarks.server_process import ServerProcess

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


async def one_stream(client: httpx.AsyncClient, url: str, model: str, tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0 = time.perf_counter()
    events, text, usage = [], [], None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    events.append(time.perf_counter())
                    text.append(ch["delta"]["content"])
    n = usage["completion_tokens"]
    span = events[-1] - events[0] if len(events) > 1 else float("nan")
    return {"ttft_s": events[0] - t0, "decode_tok_s": (n - 1) / span, "tokens": n, "text": "".join(text)}


async def run_level(url: str, model: str, concurrency: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one_stream(client, url, model, tokens) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "total_tok_s": sum(r["tokens"] for r in rows) / wall,
            "ttft_ms_mean": 1e3 * statistics.mean(r["ttft_s"] for r in rows),
            "stream_tok_s_mean": statistics.mean(r["decode_tok_s"] for r in rows),
            "identical": len({r["text"] for r in rows}) == 1, "wall_s": wall}


def bench_server(args: argparse.Namespace, graphs: bool, log_dir: Path) -> list[dict]:
    os.environ["TANDEM_CUDA_GRAPHS"] = "1" if graphs else "0"  # inherited by the server process
    max_running = max(args.concurrency_list)
    server = ServerProcess(["--model", args.model, "--device", args.device, "--dtype", args.dtype,
                            "--moe-backend", args.moe_backend, "--max-running-requests", str(max_running),
                            "--max-seq-len", str(args.decode_tokens + 256), *args.server_arg],
                           log_dir / f"serve-graphs-{int(graphs)}.log")
    rows = []
    try:
        server.wait_ready(args.startup_timeout)
        model = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        asyncio.run(run_level(server.url, model, 1, 8))  # warm-up
        sizes = httpx.get(f"{server.url}/engine/v1/stats", timeout=30).json().get("cuda_graph_sizes")
        for c in args.concurrency_list:
            row = asyncio.run(run_level(server.url, model, c, args.decode_tokens))
            rows.append({"graphs": graphs, "graph_sizes": sizes, "model": args.model, "backend": args.moe_backend,
                         "device": args.device, "decode_tokens": args.decode_tokens, **row,
                         "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})
    except Exception as exc:  # report and keep the other setting's numbers
        rows.append({"graphs": graphs, "error": f"{type(exc).__name__}: {exc}", "log_tail": server.log_tail()})
    finally:
        server.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="demo")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--moe-backend", default="resident")
    p.add_argument("--concurrency", default="1,4,8", help="comma-separated numbers of simultaneous streams")
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--graphs", default="on,off", help="decode CUDA graphs: on, off or both")
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--server-arg", action="append", default=[], help="extra `tandem serve` flag (repeat)")
    p.add_argument("--log-dir", type=Path, default=Path("runs/bench_serving"))
    p.add_argument("--json", type=Path, help="write all rows to this JSON file")
    args = p.parse_args(argv)
    args.concurrency_list = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for g in [x.strip() for x in args.graphs.split(",") if x.strip()]:
        rows += bench_server(args, g == "on", args.log_dir)
    cols = ["graphs", "concurrency", "total_tok_s", "stream_tok_s_mean", "ttft_ms_mean", "identical"]
    print(" | ".join(f"{c:>17}" for c in cols))
    for r in rows:
        if "error" in r:
            print(f"graphs={r['graphs']}: FAILED {r['error'][:150]}")
            continue
        print(" | ".join(f"{r[c]:>17.2f}" if isinstance(r[c], float) else f"{str(r[c]):>17}" for c in cols))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
    return 0 if rows and all("error" not in r and r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Single-stream decode throughput of a MoE model as a client sees it, one real server per backend.

For each backend: start `tandem serve` (its own process), poll /health until serving, read the model id
from /v1/models, send one warm-up request (brings the expert cache to its steady decode working set),
then the measured one: a streamed chat completion with stream_options.include_usage and ignore_eos, so
exactly D tokens decode. Timestamps are taken per SSE event:

    decode_tok_s = (completion_tokens - 1) / (t_last_event - t_first_event)

which stays right when the detokenizer merges several tokens into one event. Unlike the reference, the
engine's own stats are read too (expert miss rate, fetch split, VRAM, and its mean decode step over the
measured request: ``engine_step_ms``, so ``serving_ms_per_token`` = the client's time per token minus it
is what HTTP, scheduling and streaming add), and output_sha1 (first 12 hex of the text's sha1) lets you
check that the backends agree.

    python benchmarks/bench_decode_moe.py --model synthetic:qwen3-30b-a3b?layers=24 \
        --backend resident,offload,cpu,hybrid,auto --gpu-memory-limit 24 --greedy --json out.jsonl

    # sweep the share of experts cached (one server per backend and rate; resident once) and plot it
    python benchmarks/bench_decode_moe.py --model synthetic:qwen3-30b-a3b?layers=24 \
        --backend resident,offload,hybrid,auto --cache-rate 0.2,0.33,0.5,0.75 --json sweep.jsonl --plot sweep.png

With ``--ceilings ceilings.json`` (what ``python -m benchmarks.ceilings`` writes, measured in the same
run) every row also gets its bandwidth bound: the missed experts' bytes per decode token (miss rate x top-k x
MoE layers x expert bytes, plus the experts copied ahead by --moe-prefetch) over the ceiling of the path
the backend uses — offload the PCIe gather, cpu the CPU's stream read, hybrid (and auto when it runs
hybrid) the concurrent PCIe + CPU pair — and decode tok/s as a share of it.

Identical servers differ by several percent (±7 % for hybrid on the H200 host), so
``--repeat N`` starts N servers per backend (and rate), in rounds — every configuration once, then again —
so that drift over time spreads over all of them, and prints the mean, min and max per configuration.

For cpu, hybrid and auto servers ``worker_preemptions`` counts how often the CPU executor's workers lost
their core during the measured request (each time, that worker's share of a layer waited): it tells
whether the client or anything else on the host shares their cores (on the H200 host 17-94 per 128 tokens,
and a client kept off the workers' cores decoded no faster).

A row measured while `auto` was still timing its two candidates or hybrid still searching its split
(both read from the engine's stats as the measured request starts) lists what in ``unsettled``, and the
run ends with a warning to raise ``--warmup-tokens``: such a tok/s belongs to trial configurations.

A failing backend (even a crash mid-stream) is recorded and the others still run; the exit code is
non-zero if any failed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from benchmarks.bounds import BOUND_CEILINGS, load_ceilings, missed_bytes_bound
from benchmarks.server_process import ServerProcess
from benchmarks.stats import percentile

PROMPTS = Path(__file__).parent / "prompts" / "math.jsonl"
BOXED_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
# Used for fields the checkpoint's generation_config leaves out: the server's own default is greedy,
# which would silently degrade a checkpoint without full sampling advice.
FALLBACK_SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 64}
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1}


def load_prompt(path: Path, index: int) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    row = rows[index % len(rows)]
    text = row.get("prompt") or row["problem"]
    return text if "\\boxed" in text else f"{text}\n{BOXED_INSTRUCTION}"


def resolve_sampling(generation_config: dict, greedy: bool) -> dict:
    """Sampling from the checkpoint's generation_config, FALLBACK_SAMPLING for missing fields."""
    if greedy or generation_config.get("do_sample") is False or generation_config.get("temperature") == 0.0:
        return dict(GREEDY)
    out = {k: generation_config.get(k, v) for k, v in FALLBACK_SAMPLING.items()}
    if out["top_k"] in (0, None):  # HF: 0 = no filter; the API says -1
        out["top_k"] = -1
    return out


def stream_chat(url: str, model: str, prompt: str, max_tokens: int, sampling: dict, seed: int) -> dict:
    body = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "stream": True, "stream_options": {"include_usage": True}, "seed": seed,
        "temperature": sampling["temperature"], "top_p": sampling["top_p"],
        "top_k": sampling["top_k"], "ignore_eos": True,  # extensions: exactly D decode steps
    }
    t_sent = time.perf_counter()
    event_times: list[float] = []
    text, usage = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=None) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.read().decode(errors='replace')[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:  # the server failed the request mid-stream: its reason, not "ended early"
                raise RuntimeError(f"error event after {len(event_times)} events: {json.dumps(chunk['error'])[:500]}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                content = choice.get("delta", {}).get("content")
                if content:
                    event_times.append(time.perf_counter())
                    text.append(content)
    if usage is None or len(event_times) < 2:
        raise RuntimeError(f"stream ended early: {len(event_times)} events, usage={usage}")
    gaps_ms = [(b - a) * 1e3 for a, b in zip(event_times, event_times[1:])]
    full = "".join(text)
    return {
        "decode_tok_s": (usage["completion_tokens"] - 1) / (event_times[-1] - event_times[0]),
        "ttft_ms": (event_times[0] - t_sent) * 1e3,
        "event_ms_p50": percentile(gaps_ms, 50),
        "event_ms_p99": percentile(gaps_ms, 99),
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "output_sha1": hashlib.sha1(full.encode()).hexdigest()[:12],
    }


def backend_stats(stats: dict) -> dict:
    """The expert backend's part of the engine's stats JSON ({} for a model without one)."""
    return stats.get("experts") or stats.get("backend") or {}


def worker_preemptions(before: dict, after: dict) -> int | None:
    """How often the CPU executor's workers lost their core between two stats reads (cpu, hybrid and auto;
    None without an executor). An executor built after ``before`` (auto switching to hybrid) counts from 0."""
    ex_before, ex_after = (backend_stats(s).get("cpu_executor") or {} for s in (before, after))
    if "worker_preemptions" not in ex_after:
        return None
    return ex_after["worker_preemptions"] - ex_before.get("worker_preemptions", 0)


def still_searching(stats: dict) -> list[str]:
    """What of the backend was still being decided in ``stats`` (read as the measured request starts): auto's
    online trial of both candidates, and hybrid's split search of the bs=1 bucket. A request measured
    meanwhile times trial configurations, not the backend as it will serve."""
    experts = backend_stats(stats)
    out = []
    if (experts.get("auto") or {}).get("settled") is False:
        out.append("auto's trial of offload and hybrid")
    if ((experts.get("buckets") or {}).get("1") or {}).get("settling"):
        out.append("hybrid's split search")
    return out


def engine_summary(stats: dict) -> dict:
    """Miss rate, fetch split and VRAM from the engine's stats JSON (absent keys stay None)."""
    experts = backend_stats(stats)
    hits, misses = experts.get("hits"), experts.get("misses")
    fetched, cpu = experts.get("fetched"), experts.get("cpu_computed")
    return {
        "miss_rate": misses / (hits + misses) if hits is not None and misses is not None and hits + misses else None,
        "fetch_share": fetched / (fetched + cpu) if fetched is not None and cpu is not None and fetched + cpu else None,
        "fetch_fraction": experts.get("fetch_fraction"),
        "cache_policy": experts.get("policy"),  # --moe-cache-policy (None: resident, no cache)
        "prefetched": experts.get("prefetched"),  # --moe-prefetch: experts copied ahead (not counted as misses)
        # --moe-peer-devices: share of the fetched misses copied from a peer GPU instead of the host
        "peer_share": experts["peer_fetched"] / fetched if experts.get("peer_fetched") is not None and fetched else None,
        "vram_gib": stats.get("vram_gib"),
        "split": experts.get("split"),  # hybrid/cpu: the controller's measured rates, c_sync, target
        "auto": experts.get("auto"),  # auto: the profile's choice and the online verdict
    }


def bandwidth_bound(row: dict, ceilings: dict) -> dict:
    """The row's bound (module docstring): bytes_per_token, bound_tok_s, bound_ratio and the ceilings used;
    {} for backends without one (resident) or rows without the needed stats."""
    moe, rate = row.get("moe"), row.get("miss_rate")
    kind = row["backend"] if row["backend"] != "auto" else (row.get("auto") or {}).get("running")
    if not moe or rate is None or kind not in BOUND_CEILINGS or not row.get("completion_tokens"):
        return {}
    ahead = (row.get("prefetched") or 0) / row["completion_tokens"]  # experts copied ahead per token
    per_token = (rate * moe["top_k"] * moe["layers"] + ahead) * moe["expert_bytes"]
    return missed_bytes_bound(kind, per_token, row["decode_tok_s"], ceilings)


def warmup_tokens(args: argparse.Namespace) -> int:
    return args.warmup_tokens if args.warmup_tokens is not None else args.decode_tokens


def server_args(args: argparse.Namespace, backend: str, cache_rate: float | None) -> list[str]:
    out = ["--model", args.model, "--device", args.device, "--dtype", args.dtype, "--moe-backend", backend,
           "--max-running-requests", "1", "--max-seq-len", str(args.max_prompt_tokens + max(args.decode_tokens, warmup_tokens(args)))]
    if backend != "resident":
        if args.cache_size:
            out += ["--moe-cache-size", str(args.cache_size)]
        elif cache_rate:
            out += ["--moe-cache-rate", str(cache_rate)]
        else:
            out += ["--moe-cache-auto"]
        if args.gpu_memory_limit:
            out += ["--gpu-memory-limit", str(args.gpu_memory_limit)]
        out += ["--moe-hybrid-max-fetch", str(args.hybrid_max_fetch)]
    return out + args.server_arg


def run_backend(args: argparse.Namespace, backend: str, cache_rate: float | None, prompts: tuple[str, str],
                log_dir: Path, round_: int = 1) -> dict:
    """One server: warm-up request on prompts[0], the measured one on prompts[1]."""
    warmup_prompt, prompt = prompts
    row: dict = {"backend": backend, "model": args.model, "decode_tokens": args.decode_tokens,
                 "cache_rate": cache_rate, "round": round_,
                 "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    suffix = (f"-{cache_rate}" if cache_rate is not None else "") + (f"-r{round_}" if args.repeat > 1 else "")
    server = ServerProcess(server_args(args, backend, cache_rate), log_dir / f"serve-{backend}{suffix}.log")
    row["command"] = server.command
    try:
        server.wait_ready(args.startup_timeout)
        model_id = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]["id"]
        info = httpx.get(f"{server.url}/engine/v1/info", timeout=10).json()
        sampling = resolve_sampling(info.get("generation_config") or {}, args.greedy)
        row["sampling"] = sampling
        warm = stream_chat(server.url, model_id, warmup_prompt, warmup_tokens(args), sampling, args.seed)
        row["warmup_prompt_tokens"] = warm["prompt_tokens"]
        before = httpx.get(f"{server.url}/engine/v1/stats", timeout=10).json()
        row["unsettled"] = still_searching(before)
        row.update(stream_chat(server.url, model_id, prompt, args.decode_tokens, sampling, args.seed))
        after = httpx.get(f"{server.url}/engine/v1/stats", timeout=10).json()
        row.update(engine_summary(_delta(before, after)))
        preempted = worker_preemptions(before, after)
        if preempted is not None:
            row["worker_preemptions"] = preempted
        row.update(step_split(row, before, after))
        row["vram_gib"] = after.get("vram_gib")
        row["moe"] = info.get("moe")
        if args.ceilings is not None:
            row.update(bandwidth_bound(row, args.ceilings))
        row["ok"] = True
    except Exception as exc:  # one failing backend must not stop the others
        row.update(ok=False, error=f"{type(exc).__name__}: {exc}", log_tail=server.log_tail())
    finally:
        server.stop()
    return row


def _delta(before: dict, after: dict) -> dict:
    """Counters of the measured request alone (after - before); gauges from ``after``."""
    b, a = backend_stats(before), backend_stats(after)
    def counter(k: str) -> bool:  # a number on both sides (a rate may be None before its first measurement)
        return k != "fetch_fraction" and all(isinstance(v, (int, float)) for v in (a[k], b.get(k, 0)))

    experts = {k: a[k] - b.get(k, 0) if counter(k) else a[k] for k in a}
    return {"experts": experts, "vram_gib": after.get("vram_gib")}


def step_split(row: dict, before: dict, after: dict) -> dict:
    """The client's time per token split into the engine's decode step (forward + sampling, timed on its
    model thread over the measured request) and what the serving path adds (HTTP, scheduling, streaming);
    {} when the engine does not report its steps. The stream's first event can reach the client later than
    the token behind it was made (the first chunk costs the server more), which shortens the client's
    window by up to a step: on a short request the serving part can read slightly negative.
    With decode overlap (``chained_share``: the decode steps launched before the step ahead of them was
    read) a step's time is the period between two steps' tokens, which holds the serving work: the
    serving part then reads ~0 by construction."""
    steps = after.get("decode_steps", 0) - before.get("decode_steps", 0)
    if steps <= 0 or not row.get("decode_tok_s"):
        return {}
    step_ms = (after["decode_step_seconds"] - before["decode_step_seconds"]) / steps * 1e3
    chained = after.get("chained_steps", 0) - before.get("chained_steps", 0)
    return {"engine_step_ms": step_ms, "serving_ms_per_token": 1e3 / row["decode_tok_s"] - step_ms,
            "chained_share": chained / steps}


def table_line(cells: list) -> str:
    """One line of the printed tables: 12-wide cells, floats to 3 decimals."""
    return " | ".join(f"{c:>12.3f}" if isinstance(c, float) else f"{str(c):>12}" for c in cells)


def print_table(rows: list[dict]) -> None:
    cols = ["backend", "cache_rate", "decode_tok_s", "ttft_ms", "event_ms_p50", "event_ms_p99", "engine_step_ms",
            "miss_rate", "fetch_share", "vram_gib", "output_sha1"]
    if any("bound_tok_s" in r for r in rows):
        cols[9:9] = ["bound_tok_s", "bound_ratio"]
    print(table_line(cols))
    for r in rows:
        if not r.get("ok"):
            print(f"{r['backend']:>12} | FAILED: {r.get('error', '')[:100]}")
            continue
        print(table_line([r.get(c) for c in cols]))


def summarize(rows: list[dict]) -> list[dict]:
    """Per (backend, cache rate), over its successful servers: n, decode tok/s mean / min / max, TTFT mean."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["backend"], r["cache_rate"]), []).append(r)
    out = []
    for (backend, rate), runs in groups.items():
        ok = [r for r in runs if r.get("ok")]
        tok_s = [r["decode_tok_s"] for r in ok]
        out.append({"backend": backend, "cache_rate": rate, "servers": len(runs), "ok": len(ok),
                    "tok_s_mean": statistics.fmean(tok_s) if ok else None, "tok_s_min": min(tok_s, default=None),
                    "tok_s_max": max(tok_s, default=None),
                    "ttft_ms_mean": statistics.fmean(r["ttft_ms"] for r in ok) if ok else None})
    return out


def print_summary(summary: list[dict]) -> None:
    cols = ["backend", "cache_rate", "servers", "ok", "tok_s_mean", "tok_s_min", "tok_s_max", "ttft_ms_mean"]
    print(table_line(cols))
    for s in summary:
        print(table_line([s[c] for c in cols]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint dir, 'demo' or 'synthetic:NAME[?layers=N]'")
    p.add_argument("--backend", default="offload,cpu,hybrid", help="comma-separated backends, one server each")
    p.add_argument("--device", default="cuda", help="compute device of the server")
    p.add_argument("--dtype", default="bfloat16", help="server dtype")
    p.add_argument("--decode-tokens", "-D", type=int, default=256, help="tokens decoded in the measured request")
    p.add_argument("--warmup-tokens", type=int,
                   help="tokens of the warm-up request (default: --decode-tokens); hybrid searches its split for "
                        "~250 decode steps, after auto has timed both candidates (~80 steps): give them ~1024; "
                        "a row whose split or trial was still running when measured says so (unsettled) and warns")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="room left for the prompt in --max-seq-len")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL with 'problem' or 'prompt' fields")
    p.add_argument("--prompt-index", type=int, default=0, help="which prompt of the file")
    p.add_argument("--warmup-prompt-index", type=int,
                   help="the warm-up request's prompt (default: --prompt-index). The same prompt warms the cache "
                        "with the very routing the measured request repeats, which flatters a cache that remembers "
                        "use counts (--moe-cache-policy lfu): compare policies with another one")
    p.add_argument("--cache-size", type=int, help="--moe-cache-size for the server (default: --moe-cache-auto)")
    p.add_argument("--cache-rate", type=str,
                   help="--moe-cache-rate for the server; a comma list sweeps (one server per backend and rate)")
    p.add_argument("--gpu-memory-limit", type=float, help="--gpu-memory-limit GiB for the server")
    p.add_argument("--hybrid-max-fetch", type=int, default=-1, help="--moe-hybrid-max-fetch (-1 auto)")
    p.add_argument("--greedy", action="store_true", help="force greedy sampling (strict cross-backend check)")
    p.add_argument("--seed", type=int, default=0, help="request seed")
    p.add_argument("--startup-timeout", type=float, default=600, help="seconds to wait for /health to say serving")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag passed to the server (repeat)")
    p.add_argument("--repeat", type=int, default=1,
                   help="servers per backend (and rate), run in rounds; prints mean / min / max per configuration")
    p.add_argument("--log-dir", type=Path, default=Path("runs/bench_decode"), help="server logs go here")
    p.add_argument("--json", type=Path, help="append one JSON line per backend (and cache rate) here")
    p.add_argument("--plot", type=Path, help="also plot tok/s against the share of experts cached to this PNG")
    p.add_argument("--ceilings", type=Path,
                   help="ceilings JSON of this host (python -m benchmarks.ceilings, same run): add each row's "
                        "bandwidth bound and ratio")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.ceilings is not None:
        args.ceilings = load_ceilings(args.ceilings)  # a bad file fails here, before any server starts

    args.log_dir.mkdir(parents=True, exist_ok=True)
    warmup_index = args.prompt_index if args.warmup_prompt_index is None else args.warmup_prompt_index
    prompts = (load_prompt(args.prompts, warmup_index), load_prompt(args.prompts, args.prompt_index))
    rates = [float(r) for r in args.cache_rate.split(",")] if args.cache_rate else [None]
    runs = [(b.strip(), None if b.strip() == "resident" else rate)
            for b in args.backend.split(",") if b.strip() for rate in rates]
    runs = list(dict.fromkeys(runs))  # resident once, whatever the sweep
    rounds = [(i + 1, backend, rate) for i in range(args.repeat) for backend, rate in runs]
    rows = []
    for round_, backend, rate in tqdm(rounds, desc="bench_decode_moe", unit="server", file=sys.stderr):
        row = run_backend(args, backend, rate, prompts, args.log_dir, round_)
        row["warmup_prompt_index"] = warmup_index
        rows.append(row)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
    print_table(rows)
    if args.repeat > 1:
        print()
        print_summary(summarize(rows))
    if args.plot:
        from benchmarks.plot_decode import plot_rows

        print(f"plot: {plot_rows(rows, args.plot)}")
    for r in rows:
        if r.get("unsettled"):
            print(f"warning: {r['backend']} (cache rate {r['cache_rate']}): {' and '.join(r['unsettled'])} still ran "
                  f"when the measured request started, so its tok/s is not the steady state; raise --warmup-tokens "
                  f"(now {warmup_tokens(args)})", file=sys.stderr)
    failed = [r["backend"] for r in rows if not r.get("ok")]
    if failed:
        print(f"failed backends: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

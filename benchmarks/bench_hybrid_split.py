"""Where the fetch/CPU split's optimum lies, and whether the controller finds it (issue 4).

    python -m benchmarks.bench_hybrid_split [--model synthetic:qwen3-30b-a3b?layers=24] [--cache-rate 0.33] \
        [--configs offload,cpu,hybrid:1,hybrid:2,hybrid:3,hybrid] [--json out.json] [--plot out.png]

One process loads the model once (CUDA, bf16, banks pinned; ``--device cpu``: fp32 and eager decode, a
smoke run of the tool), then for each config builds the expert
backend with the same number of cache slots and the engine's own ModelRunner (its captured decode
graphs), prefills a prompt and decodes bs=1, sampling each token at --temperature and reading it on the
host as the server does:

    offload      every miss fetched over PCIe
    cpu          every miss computed by the CPU executor
    hybrid:N     at most N misses per layer fetched, the rest on the CPU (--moe-hybrid-max-fetch N)
    hybrid       the engine's own split: cost model, then the tuner (--moe-hybrid-max-fetch -1)
    ...+pP       any of them with the next layer's P likeliest uncached experts copied ahead (--moe-prefetch P)
    ...+tT       cpu/hybrid with T CPU executor workers (--moe-cpu-threads T)
    ...+lru      any of them with the LRU cache policy (--moe-cache-policy lru; without it: the engine's default,
                 lfu, or lru with +pP)
    ...+lfu      any of them with the LFU cache policy (--moe-cache-policy lfu; not with +pP)
    ...+cN       lfu's use counts halved, every layer's, when one reaches N (--moe-cache-lfu-cap N)

Per config: ms/token (mean, p50, p99), misses, fetched and CPU experts per layer, and for hybrid/cpu the
per-layer GPU side (signal -> wait entry: copy of the fetched experts + GEMM of the resident ones), how
long the GPU then waited for the CPU, and the serial part (the CPU's result in -> the next layer's job
out: attention, router, split, staging, while the CPU idles), all from the handoff's %globaltimer
stamps; the CPU executor's time per job and rate, and the split of the bs=1 bucket (the backend tunes one
split per batch-size bucket): its final fraction, mode, whether its tuner settled, the tuner's scan. With
--profile-steps N, the GPU kernels of N more steps (torch.profiler) per config. With --ceilings (the same
machine's `python -m benchmarks.ceilings`), each row's bound: the missed experts' bytes per token over its
path's ceiling, and for cpu/hybrid the serial-aware bound that adds the measured serial part per layer
(benchmarks/bounds.py); `--replot old.json --ceilings c.json` adds them to an earlier run. The fixed caps
trace the curve; the controller should land on its minimum. Performance lives here, never in unit tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks.bounds import load_ceilings, missed_bytes_bound
from benchmarks.gpu_profile import format_kernels, kernel_profile
from benchmarks.stats import percentile
from services.engine.config import LFU_CAP_MAX, EngineConfig, MoEBackend
from services.engine.models.registry import load_model, pin_banks
from services.engine.moe.backends import BackendContext
from services.engine.moe.hybrid import HybridBackend
from services.engine.moe.offload import OffloadBackend
from services.engine.moe.prefetch import next_layer_predictors
from services.engine.moe.split import Q16
from services.engine.runtime.kv_cache import ForwardBatch
from services.engine.runtime.runner import ModelRunner

MEASURED_BUCKET = "1"  # the split bucket of a bs=1 decode step


@dataclass(frozen=True)
class Config:
    kind: str  # offload | cpu | hybrid
    max_fetch: int = -1  # --moe-hybrid-max-fetch
    prefetch: int = 0  # --moe-prefetch
    cpu_threads: int = 0  # --moe-cpu-threads (0: the engine's default)
    policy: str | None = None  # --moe-cache-policy lru | lfu (None: the engine's default)
    lfu_cap: int | None = None  # --moe-cache-lfu-cap (None: the engine's default)


def parse_config(config: str) -> Config:
    """'KIND[:N][+pP][+tT][+cN][+lru|+lfu]' (KIND offload | cpu | hybrid; :N hybrid's fixed cap; +pP
    --moe-prefetch P; +tT --moe-cpu-threads T; +cN
    --moe-cache-lfu-cap N; +lru / +lfu --moe-cache-policy, lfu not with +pP) -> Config; SystemExit naming a
    bad one."""
    head, *options = config.split("+")
    kind, _, cap = head.partition(":")
    policies = [o for o in options if o in ("lru", "lfu")]
    options = [o for o in options if o not in policies]
    flags = {o[:1]: o[1:] for o in options}
    bad = (kind not in ("offload", "cpu", "hybrid") or (cap and (kind != "hybrid" or not cap.isdigit()))
           or len(flags) != len(options) or any(k not in "ptc" or not v.isdigit() for k, v in flags.items())
           or len(policies) > 1 or ("lfu" in policies and "p" in flags)
           or not 2 <= int(flags.get("c", 2)) <= LFU_CAP_MAX)
    if bad:
        raise SystemExit(f"bench_hybrid_split: --configs: unknown config {config!r} "
                         "(offload | cpu | hybrid | hybrid:N, then optional +pP, +tT, "
                         f"+cN (N in 2..{LFU_CAP_MAX}) and one of +lru, +lfu (lfu not with +pP))")
    return Config(kind, int(cap) if cap else -1, int(flags.get("p", 0)), int(flags.get("t", 0)),
                  policies[0] if policies else None, int(flags["c"]) if "c" in flags else None)


def build(lm, config: str, num_slots: int):
    """A backend for ``config`` over the loaded banks with num_slots slots."""
    c = parse_config(config)
    cfg = EngineConfig(model=lm.model_id, device=lm.device.type, moe_backend=c.kind, moe_hybrid_max_fetch=c.max_fetch,
                       moe_prefetch=c.prefetch, moe_cpu_threads=c.cpu_threads,
                       moe_cache_policy=c.policy, **({"moe_cache_lfu_cap": c.lfu_cap} if c.lfu_cap else {}))
    ctx = BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, lm.model.non_expert_nbytes(),
                         next_layer_predictors=next_layer_predictors(lm.model) if c.prefetch else None)
    if c.kind == "offload":
        return OffloadBackend(ctx, num_slots=num_slots)
    return HybridBackend(ctx, MoEBackend(c.kind), num_slots=num_slots)


def cache_counts(backend) -> tuple[int, int, int]:
    """misses, fetched (this layer's own) and experts copied ahead by the next-layer prefetch, so far."""
    s = backend.cache.state
    prefetch = backend.prefetch if isinstance(backend, OffloadBackend) else backend.offload.prefetch
    ahead = int(prefetch.state.fetched.sum()) if prefetch is not None else 0
    return int(s.misses.sum()), int(s.fetched.sum()), ahead


def executor_totals(backend: HybridBackend) -> dict:
    """The CPU executor's jobs, experts, compute seconds and last error so far: the graph-mode poller's
    counters, or the backend's own (eager decode: the CPU smoke run)."""
    if backend.graph_mode:
        return backend.handoff.poll_stats()
    t = backend.totals
    return {"jobs": t["cpu_jobs"], "experts": t["cpu_experts"], "compute_s": t["cpu_compute_s"], "error": None}


def measured_split(backend: HybridBackend) -> dict:
    """The split state of the bucket this bench measures: bs=1 decode, bucket "1" (the backend keeps one
    cost model and tuner per batch-size bucket, services/engine/moe/split_buckets.py)."""
    state = backend.buckets.states[backend.buckets.by_name[MEASURED_BUCKET]]
    stats = state.stats()
    return {"fetch_fraction": state.q16 / Q16,  # what the bucket's split kernels read now
            "split_mode": stats["mode"], "split_settled": not stats["settling"], "bucket_steps": stats["steps"],
            "c_sync_us": backend.c_sync_calibrated * 1e6, "tuner": stats["tuner"]}


@torch.inference_mode()
def run_config(lm, config: str, num_slots: int, prompt: list[int], args) -> dict:
    backend = build(lm, config, num_slots)
    lm.model.set_backend(backend)
    runner = ModelRunner(lm, 1, args.max_seq_len, lm.device, lm.dtype, backend_name=parse_config(config).kind)
    handoff = getattr(backend, "handoff", None)
    stamps = getattr(handoff, "stamps", None)  # graph mode: [L, 3] signal / wait entry / wait exit (ns)
    gen = torch.Generator(device=lm.device).manual_seed(0)

    def sample(logits: torch.Tensor) -> int:  # [1, V] -> token (Gumbel-max at the temperature; host sync)
        if args.temperature <= 0:
            return int(logits[0].argmax())
        u = torch.rand(logits.shape, device=logits.device, generator=gen).clamp_(min=1e-10)
        return int((logits[0].float() / args.temperature - torch.log(-torch.log(u[0]))).argmax())

    def forward(ids: list[int], start: int) -> torch.Tensor:  # eager: the prefill, and decode on the CPU
        return lm.model(torch.tensor(ids, device=lm.device), torch.arange(start, start + len(ids), device=lm.device),
                        ForwardBatch(slots=[0], start_pos=[start], query_lens=[len(ids)]), runner.kv)

    try:
        graphed = runner.graphs is not None and 1 in runner.graphs.graphs
        if lm.device.type == "cuda" and not graphed:
            raise RuntimeError("no CUDA graph was captured for decode batch 1 (see the log)")
        token, pos = sample(forward(prompt, 0)), len(prompt)

        def step() -> None:  # and report the step time to the backend, as the engine does
            nonlocal token, pos
            t0 = time.perf_counter()
            logits = runner.graphs.run([token], [pos], [0]) if graphed else forward([token], pos)
            token, pos = sample(logits), pos + 1
            observe = getattr(backend, "observe_decode_step", None)
            if observe is not None:
                observe(time.perf_counter() - t0, 1)

        for _ in range(args.warmup):  # the cache reaches its decode working set; the controller settles
            step()
        counts0 = cache_counts(backend)
        hybrid = isinstance(backend, HybridBackend)
        cpu0 = executor_totals(backend) if hybrid else None
        times, gpu_side, waits, serial = [], [], [], []
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
            if stamps is not None:
                layers_ns = stamps.tolist()
                for sig, enter, leave in layers_ns:
                    gpu_side.append(enter - sig)
                    waits.append(leave - enter)
                # CPU's result in -> next layer's job out: attention, router, split, staging (the CPU idles)
                serial += [nxt[0] - cur[2] for cur, nxt in zip(layers_ns, layers_ns[1:])]
        misses, fetched, ahead = (a - b for a, b in zip(cache_counts(backend), counts0))
        layers = len(lm.banks.layers) * args.tokens
        row = {"config": config, "tokens": args.tokens, "ms_per_token": 1e3 * statistics.fmean(times),
               "ms_p50": 1e3 * percentile(times, 50), "ms_p99": 1e3 * percentile(times, 99),
               "misses_per_layer": misses / layers, "fetched_per_layer": fetched / layers,
               "prefetched_per_layer": ahead / layers,
               "miss_rate": misses / (layers * lm.spec.top_k), "cache_policy": "lfu" if backend.cache.lfu else "lru",
               "lfu_cap": backend.cache.use_cap}
        row["tok_s"] = 1e3 / row["ms_per_token"]
        if hybrid:  # cpu and hybrid: the CPU executor's share and the measured bucket's split
            cpu = executor_totals(backend)
            cpu_experts, cpu_s = cpu["experts"] - cpu0["experts"], cpu["compute_s"] - cpu0["compute_s"]
            row.update(cpu_experts_per_layer=cpu_experts / layers,
                       cpu_gbs=cpu_experts * backend.expert_bytes / cpu_s / 1e9 if cpu_s else None,
                       cpu_job_us=cpu_s / max(1, cpu["jobs"] - cpu0["jobs"]) * 1e6,
                       executor_error=cpu["error"], **measured_split(backend))
        if stamps is not None:  # graph mode: the handoff's per-layer %globaltimer stamps
            row.update(gpu_side_us=statistics.fmean(gpu_side) / 1e3, wait_us=statistics.fmean(waits) / 1e3,
                       serial_us=statistics.fmean(serial) / 1e3)
        if args.profile_steps and lm.device.type == "cuda":
            try:
                row["kernels"] = kernel_profile(step, args.profile_steps)
            except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timed row
                row["kernels_error"] = f"{type(exc).__name__}: {exc}"
        return row
    finally:
        runner.close()  # its compile watch: the next config's warm-up compiles are not "while serving"
        lm.model.set_backend(None)
        close = getattr(backend, "close", None)
        if close is not None:
            close()
        del backend, runner
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def print_kernels(rows: list[dict]) -> None:
    for r in rows:
        if r.get("kernels"):
            total = sum(k["us_per_step"] for k in r["kernels"])
            print(f"\n{r['config']}: GPU kernels per decode step (top {len(r['kernels'])}: {total / 1e3:.2f} ms of "
                  f"{r['ms_per_token']:.2f} ms/token)")
            print(format_kernels(r["kernels"]))


def add_bounds(rows: list[dict], moe_layers: int, expert_bytes: int, ceilings: dict) -> None:
    """Each row's bound from the missed (and prefetched) experts' bytes per token and, where the handoff
    stamped the serial part, its serial-aware bound (benchmarks/bounds.py), in place."""
    for r in rows:
        if "error" in r:
            continue
        per_token = (r["misses_per_layer"] + r["prefetched_per_layer"]) * moe_layers * expert_bytes
        serial = r["serial_us"] * 1e-6 * moe_layers if r.get("serial_us") is not None else None
        r.update(missed_bytes_bound(parse_config(r["config"]).kind, per_token, r["tok_s"], ceilings, serial))


def moe_layers_of(report: dict) -> int | None:
    """MoE layers of an earlier --json's model: written since the bounds came; for older files, a synthetic
    preset's spec says (None for a checkpoint, whose config is not at hand)."""
    if report.get("moe_layers"):
        return report["moe_layers"]
    from services.engine.models.synthetic import is_synthetic, synthetic_spec

    return synthetic_spec(report["model"], 1).num_moe_layers if is_synthetic(report["model"]) else None


def print_table(rows: list[dict]) -> None:
    cols = [("config", "{}"), ("tok_s", "{:.1f}"), ("ms_per_token", "{:.2f}"), ("ms_p50", "{:.2f}"), ("ms_p99", "{:.2f}"),
            ("misses_per_layer", "{:.2f}"), ("fetched_per_layer", "{:.2f}"), ("prefetched_per_layer", "{:.2f}"),
            ("cpu_experts_per_layer", "{:.2f}"),
            ("gpu_side_us", "{:.0f}"), ("wait_us", "{:.0f}"), ("serial_us", "{:.0f}"), ("cpu_job_us", "{:.0f}"),
            ("cpu_gbs", "{:.1f}"), ("fetch_fraction", "{:.3f}")]
    if any("bound_tok_s" in r for r in rows):
        cols += [("bound_tok_s", "{:.1f}"), ("bound_ratio", "{:.2f}"), ("serial_aware_ratio", "{:.2f}")]
    print(" | ".join(f"{c:>12}" for c, _ in cols))
    for r in rows:
        if "error" in r:
            print(f"{r['config']:>12} | FAILED: {r['error'][:120]}")
            continue
        print(" | ".join(f"{(fmt.format(r[c]) if r.get(c) is not None else '-'):>12}" for c, fmt in cols))


SWEPT_OPTIONS = {  # Config field -> the x label of its panel (tok/s against the option, one line per kind)
    "prefetch": "experts of the next layer copied ahead per token (--moe-prefetch P)",
}


def plot(rows: list[dict], path: str, title: str) -> None:
    """tok/s against hybrid's fixed cap (the other configs as lines) and, for each option some rows set
    (+pP, +wW), a panel of tok/s against it, one line per backend kind (repeated configs: their mean)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [(parse_config(r["config"]), r) for r in rows if "error" not in r]
    plain = [(c, r) for c, r in ok if c.cpu_threads == 0]
    untouched = [(c, r) for c, r in plain if not any(getattr(c, o) for o in SWEPT_OPTIONS)]
    capped = sorted((c.max_fetch, r["tok_s"]) for c, r in untouched if c.max_fetch >= 0)
    swept = [o for o in SWEPT_OPTIONS if any(getattr(c, o) for c, _ in plain)]
    show_caps = bool(capped) or not swept  # the cap panel only when there is a curve to draw
    panels = show_caps + len(swept)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 1.5, 4), squeeze=False)
    styles = {"offload": ("r", "--"), "cpu": ("g", "--"), "hybrid": ("b", "-")}
    if show_caps:
        ax = axes[0][0]
        if capped:
            ax.plot([n for n, _ in capped], [t for _, t in capped], "o-", label="hybrid, fixed cap N")
        for c, r in untouched:
            if c.max_fetch < 0:
                color, line = styles[c.kind]
                ax.axhline(r["tok_s"], linestyle=line, color=color, label=f"{c.kind} ({r['tok_s']:.1f} tok/s)")
        ax.set_xlabel("misses fetched per layer, at most (--moe-hybrid-max-fetch)")
    for ax, option in zip(axes[0][show_caps:], swept):
        lines: dict[str, dict[int, list[float]]] = {}
        for c, r in plain:
            others = [o for o in SWEPT_OPTIONS if o != option and getattr(c, o)]
            if c.max_fetch < 0 and not others:
                lines.setdefault(c.kind, {}).setdefault(getattr(c, option), []).append(r["tok_s"])
        for kind, points in sorted(lines.items()):
            xs = sorted(points)
            ax.plot(xs, [statistics.fmean(points[x]) for x in xs], "o" + styles[kind][1], color=styles[kind][0],
                    label=kind)
        ax.set_xlabel(SWEPT_OPTIONS[option])
    for ax in axes[0]:
        ax.set_ylabel("decode tok/s (bs=1)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_hybrid_split", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b?layers=24", help="model (default: %(default)s)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (the benchmark); cpu runs decode eagerly in fp32 (a smoke run of the tool)")
    p.add_argument("--cache-rate", type=float, default=0.33, help="share of all experts given GPU slots")
    p.add_argument("--moe-expert-dtype", default="checkpoint", choices=["checkpoint", "fp8"],
                   help="experts as stored, or quantized to FP8 blocks at load (default: %(default)s)")
    p.add_argument("--configs", default="offload,cpu,hybrid:1,hybrid:2,hybrid:3,hybrid:4,hybrid",
                   help="comma list of offload | cpu | hybrid | hybrid:N, each optionally followed by +pP (prefetch P), "
                        "+tT (T CPU workers), +cN (lfu use-count cap N) and +lru or +lfu "
                        "(cache policy; default: the engine's), e.g. hybrid+p2+t14 (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="timed decode tokens per config")
    p.add_argument("--warmup", type=int, default=320,
                   help="untimed decode tokens per config first (the controller's split search settles in ~250)")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens prefilled first")
    p.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 = greedy)")
    p.add_argument("--max-seq-len", type=int, default=640, help="KV window of the decode graph")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed tokens, profile this many more steps per config and print its GPU kernels "
                        "(CUDA only; 0 = off)")
    p.add_argument("--json", help="write the rows and the run's facts to this JSON file")
    p.add_argument("--plot", help="PNG of tok/s against the fixed cap, the other configs as lines")
    p.add_argument("--replot", metavar="JSON", help="print and plot (--plot) the rows of an earlier --json; run nothing")
    p.add_argument("--ceilings", type=Path,
                   help="a ceilings JSON of the same machine (python -m benchmarks.ceilings): each row gets its bound, "
                        "bound_ratio and, for cpu/hybrid, the serial-aware ratio (benchmarks/bounds.py); "
                        "also with --replot (default: no bounds)")
    args = p.parse_args(argv)
    ceilings = load_ceilings(args.ceilings) if args.ceilings is not None else None  # a bad file fails before the load
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        if ceilings is not None:
            layers = moe_layers_of(report)
            if layers is None:
                print(f"bench_hybrid_split: {args.replot} does not say its MoE layers: no bounds", file=sys.stderr)
            else:
                add_bounds(report["rows"], layers, report["expert_bytes"], ceilings)
        print_table(report["rows"])
        print_kernels(report["rows"])
        if args.plot:
            plot(report["rows"], args.plot, f"{report['model']}, {report['cache_rate']:.0%} of experts cached, "
                                            f"{report['device']}")
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_hybrid_split: no CUDA device (--device cpu for a smoke run)", file=sys.stderr)
        return 2
    configs = args.configs.split(",")
    for config in configs:
        parse_config(config)  # a typo fails here, not after the model is loaded
    if args.prompt_len + args.warmup + args.tokens + args.profile_steps + 8 > args.max_seq_len:
        print(f"--max-seq-len {args.max_seq_len} is too small for prompt + warm-up + tokens", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    lm = load_model(EngineConfig(model=args.model, device=args.device, dtype=dtype, moe_backend="offload",
                                 moe_expert_dtype=args.moe_expert_dtype), attach_backend=False)
    if args.device == "cuda":
        pin_banks(lm.banks)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s", flush=True)
    total = len(lm.banks.layers) * lm.banks.layers[0].num_experts
    num_slots = round(args.cache_rate * total)
    prompt = torch.randint(0, lm.spec.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = []
    for config in tqdm(configs, desc="bench_hybrid_split", unit="config"):
        try:
            rows.append(run_config(lm, config, num_slots, prompt, args))
        except Exception as exc:  # one failing config must not lose the others
            rows.append({"config": config, "error": f"{type(exc).__name__}: {exc}"})
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    facts = {"model": args.model, "device": device_name, "torch": torch.__version__,
             "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cache_rate": args.cache_rate, "slots": num_slots,
             "moe_layers": len(lm.banks.layers), "expert_bytes": lm.banks.expert_nbytes(),
             "expert_format": lm.banks.layers[0].format.value, "temperature": args.temperature,
             "command": " ".join(sys.argv)}
    if ceilings is not None:
        add_bounds(rows, len(lm.banks.layers), lm.banks.expert_nbytes(), ceilings)
        facts["ceilings"] = ceilings
    print(f"{args.model}, {num_slots} slots ({args.cache_rate:.0%} of {total} experts), bs=1, T={args.temperature}")
    print_table(rows)
    print_kernels(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**facts, "rows": rows}, f, indent=2)
    if args.plot:
        plot(rows, args.plot, f"{args.model}, {args.cache_rate:.0%} of experts cached, {facts['device']}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

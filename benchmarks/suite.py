"""The benchmark suite: one command that reproduces the results page's table (how fast, against what bound) on this host.

    python -m benchmarks.suite --out runs/suite                 # a GPU host: the page's configurations
    python -m benchmarks.suite --scale tiny --out runs/tiny     # the same steps on the CPU, demo model, minutes
    tandem bench suite ...                                      # the same command

Steps, in order (``--steps`` picks some), each by calling the benchmark that owns it:

    ceilings   python -m benchmarks.ceilings: the host's PCIe, HBM and CPU DRAM ceilings -> ceilings.json
    decode     python -m benchmarks.bench_decode_moe: one real `tandem serve` per row, through the OpenAI
               API: the headline rows (resident; hybrid with a third cached; cpu with 1 % cached) and the
               sweep of offload / hybrid / auto over the share cached, each with its bound -> decode.jsonl
    serving    python -m benchmarks.bench_serving: C distinct chat streams at once, hybrid with a third cached
               -> serving.jsonl, serving.png
    resident   python -m benchmarks.bench_resident_decode: resident in one process against HBM (CUDA only)
               -> resident.json
    long       python -m benchmarks.bench_serving --prompt-tokens: time to first token of long prompts, offload
               and hybrid with a third cached on a 24 GiB budget -> long.jsonl, long.png
    routing    python -m benchmarks.bench_decode_moe on the synthetic model under the sticky and flat routing
               presets (docs/routing.md), every offloading backend at a third cached -> routing.jsonl,
               routing.png (skipped when --model is not synthetic: a real model routes as it routes)
    gguf       python -m benchmarks.bench_decode_moe on the synthetic model with its experts in GGUF blocks
               (Q4_K_M; docs/gguf.md) at a third cached, beside the decode step's rows of the same backends
               -> gguf.jsonl (skipped when --model is not synthetic: a checkpoint's experts are what they are)

then writes suite.json (every row, the ceilings and the exact command of each step), sweep.png (tok/s
against the share cached) and table.md (the page's headline table with this host's numbers).
A failed step is recorded and the others still run; the exit code is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

ROUTINGS = ("sticky", "flat")  # the routing step's presets (uniform: the decode step)
STEPS = ("ceilings", "decode", "serving", "resident", "long", "routing", "gguf")


@dataclass(frozen=True)
class Scale:
    """What one scale runs: the model, where, and the configurations of each step."""

    model: str
    device: str
    dtype: str
    decode_tokens: int
    warmup_tokens: int
    headline: tuple[tuple[str, float | None], ...]  # (backend, share of experts cached; None = resident)
    sweep_backends: str  # empty: no sweep beyond the headline rows
    sweep_rates: str
    concurrency: str
    serving_backend: str
    serving_cache_rate: float
    serving_prompts: int = 0  # requests per concurrency level; 0 = bench_serving's default, max(8, 2C)
    long_prompts: str = ""  # prompt lengths of the long step
    long_backends: str = ""  # at serving_cache_rate
    long_args: tuple[str, ...] = ()  # extra bench_serving flags of the long step (the GPU budget)
    ceilings_args: tuple[str, ...] = ()
    routing_model: str = ""  # the synthetic model of the routing step (default: the scale's model)
    routing_backends: str = "resident,offload,hybrid,auto"  # at serving_cache_rate (resident: everything cached)
    gguf_experts: str = "q4_K_M"  # the gguf step's ?experts= (its widths must be whole blocks of the type)
    gguf_backends: str = "resident,offload,hybrid"  # at serving_cache_rate


SCALES = {
    # The results page: the 24-layer cut of Qwen3-30B-A3B in bf16 on one GPU.
    "full": Scale(model="synthetic:qwen3-30b-a3b?layers=24", device="cuda", dtype="bfloat16", decode_tokens=128,
                  warmup_tokens=384, headline=(("resident", None), ("hybrid", 0.33), ("cpu", 0.01)),
                  sweep_backends="offload,hybrid,auto", sweep_rates="0.2,0.33,0.5", concurrency="1,4,8",
                  serving_backend="hybrid", serving_cache_rate=0.33, long_prompts="2048,8192,32768",
                  long_backends="hybrid,offload", long_args=("--server-arg=--gpu-memory-limit", "--server-arg=24")),
    # The same steps on a CPU in minutes: the demo checkpoint, a few tokens (what CI runs).
    "tiny": Scale(model="demo", device="cpu", dtype="float32", decode_tokens=8, warmup_tokens=8,
                  headline=(("resident", None), ("hybrid", 0.5), ("cpu", 0.25)), sweep_backends="",
                  sweep_rates="", concurrency="1,2", ceilings_args=("--buffer-mib", "64", "--reps", "3"),
                  serving_backend="hybrid", serving_cache_rate=0.5, serving_prompts=2, long_prompts="300,1200",
                  long_backends="hybrid", routing_model="synthetic:tiny", routing_backends="hybrid",
                  gguf_experts="q8_0", gguf_backends="hybrid"),  # tiny's widths (64, 32): 32-value blocks
}


def step_commands(scale: Scale, model: str, out: Path, timeout_s: float) -> dict[str, list[list[str]]]:
    """Each step's benchmark invocations as (module, *argv) lists."""
    common = ["--model", model, "--device", scale.device, "--dtype", scale.dtype,
              "--startup-timeout", str(timeout_s)]
    decode = ["benchmarks.bench_decode_moe", *common, "--decode-tokens", str(scale.decode_tokens),
              "--warmup-tokens", str(scale.warmup_tokens), "--json", str(out / "decode.jsonl"),
              "--log-dir", str(out / "logs"), "--ceilings", str(out / "ceilings.json")]
    decode_runs = [[*decode, "--backend", backend, *([] if rate is None else ["--cache-rate", str(rate)])]
                   for backend, rate in scale.headline]
    if scale.sweep_backends:
        decode_runs.append([*decode, "--backend", scale.sweep_backends, "--cache-rate", scale.sweep_rates])
    synthetic = scale.routing_model if model == scale.model and scale.routing_model else model

    def variant(query: str, backends: str, jsonl: str) -> list[list[str]]:
        """The decode command on the synthetic model with ``query`` added, into ``jsonl``; none for a checkpoint."""
        if not synthetic.startswith("synthetic:"):
            return []
        argv_ = [*decode[:2], f"{synthetic}{'&' if '?' in synthetic else '?'}{query}", *decode[3:],
                 "--backend", backends, "--cache-rate", str(scale.serving_cache_rate)]
        argv_[argv_.index(str(out / "decode.jsonl"))] = str(out / jsonl)
        return [argv_]

    return {
        "routing": [cmd for preset in ROUTINGS
                    for cmd in variant(f"routing={preset}", scale.routing_backends, "routing.jsonl")],
        "gguf": variant(f"experts={scale.gguf_experts}", scale.gguf_backends, "gguf.jsonl"),
        "ceilings": [["benchmarks.ceilings", "--json", str(out / "ceilings.json"), *scale.ceilings_args]],
        "decode": decode_runs,
        "serving": [["benchmarks.bench_serving", *common, "--backend", scale.serving_backend,
                     "--cache-rate", str(scale.serving_cache_rate), "--concurrency", scale.concurrency,
                     "--output-tokens", str(scale.decode_tokens), "--num-prompts", str(scale.serving_prompts),
                     "--log-dir", str(out / "logs"), "--json", str(out / "serving.jsonl"),
                     "--plot", str(out / "serving.png")]],
        "resident": [["benchmarks.bench_resident_decode", "--model", model, "--tokens", str(scale.decode_tokens),
                      "--json", str(out / "resident.json")]],
        "long": [["benchmarks.bench_serving", *common, "--backend", scale.long_backends, "--cache-rate",
                  str(scale.serving_cache_rate), "--prompt-tokens", scale.long_prompts, "--output-tokens", "32",
                  "--repeats", "1", *scale.long_args, "--log-dir", str(out / "logs"), "--json", str(out / "long.jsonl"),
                  "--plot", str(out / "long.png")]],
    }


def run_module(argv: list[str], log: Path) -> int:
    """``python -m argv[0] argv[1:]`` in this process (each benchmark's ``main(argv)``), its stdout into
    ``log`` as well as on the terminal."""
    module = importlib.import_module(argv[0])

    class Tee:
        def __init__(self, *streams):
            self.streams = streams

        def write(self, text: str) -> int:
            for s in self.streams:
                s.write(text)
            return len(text)

        def flush(self) -> None:
            for s in self.streams:
                s.flush()

    with open(log, "a") as f, contextlib.redirect_stdout(Tee(sys.stdout, f)):
        try:
            return int(module.main(argv[1:]) or 0)
        except SystemExit as exc:  # argparse errors and the benchmarks' own one-line refusals
            if exc.code not in (None, 0):
                print(f"{argv[0]}: {exc.code}", file=sys.stderr)
            return exc.code if isinstance(exc.code, int) else 1


def read_rows(out: Path) -> dict:
    """Everything the steps wrote under ``out``."""
    def load(name: str):
        path = out / name
        if not path.exists():
            return None
        if name.endswith(".jsonl"):
            return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return json.loads(path.read_text())

    return {"ceilings": load("ceilings.json"), "decode": load("decode.jsonl") or [],
            "serving": load("serving.jsonl") or [], "resident": load("resident.json"), "long": load("long.jsonl") or [],
            "routing": load("routing.jsonl") or [], "gguf": load("gguf.jsonl") or []}


def _fmt(value, digits: int = 1) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else "–"


def headline_rows(scale: Scale, results: dict) -> list[dict]:
    """One row per headline configuration: tok/s (mean over its servers), bound and ratio."""
    rows = []
    resident = results.get("resident") or {}
    for backend, rate in scale.headline:
        got = [r for r in results["decode"] if r.get("ok") and r["backend"] == backend and r.get("cache_rate") == rate]
        tok_s = [r["decode_tok_s"] for r in got]
        bound = next((r["bound_tok_s"] for r in got if r.get("bound_tok_s")), None)
        if backend == "resident" and bound is None:
            bound = resident.get("bound_tokens_per_second")
        vram = next((r.get("vram_gib") for r in got if r.get("vram_gib") is not None), None)
        mean = sum(tok_s) / len(tok_s) if tok_s else None
        rows.append({"backend": backend, "cache_rate": rate, "tok_s": mean, "servers": len(tok_s), "vram_gib": vram,
                     "bound_tok_s": bound, "bound_ratio": mean / bound if mean and bound else None})
    return rows


def gguf_lines(scale: Scale, results: dict) -> list[str]:
    """The gguf step's table: each backend's tok/s with GGUF experts beside the decode step's rows of the same model
    with its own experts, backend and share cached (none at the tiny scale, whose decode step serves the demo)."""
    lines = ["", f"## GGUF experts ({scale.gguf_experts}, {100 * scale.serving_cache_rate:g} % cached; docs/gguf.md)", "",
             "| backend | tok/s | own experts tok/s | ratio | bound tok/s | of the bound |", "|---|---|---|---|---|---|"]
    for r in results.get("gguf") or []:
        if not r.get("ok"):
            lines.append(f"| {r['backend']} | failed: {str(r.get('error', ''))[:80]} | | | | |")
            continue
        model = r["model"].replace(f"experts={scale.gguf_experts}", "").rstrip("?&")
        own = [d["decode_tok_s"] for d in results["decode"]  # resident rows: cache_rate None in both
               if d.get("ok") and d.get("model") == model and d["backend"] == r["backend"]
               and d.get("cache_rate") == r.get("cache_rate")]
        base = sum(own) / len(own) if own else None
        lines.append(f"| {r['backend']} | {_fmt(r['decode_tok_s'])} | {_fmt(base)} | "
                     f"{_fmt(r['decode_tok_s'] / base if base else None, 2)} | {_fmt(r.get('bound_tok_s'))} | "
                     f"{_fmt(r.get('bound_ratio'), 2)} |")
    return lines


def markdown(scale: Scale, model: str, results: dict, commands: dict[str, list[str]]) -> str:
    ceilings = results.get("ceilings") or {}
    host = f"{ceilings.get('gpu') or 'no GPU'}, {ceilings.get('cpu', '?')} ({ceilings.get('nproc', '?')} threads)"
    lines = [f"# Benchmark suite: {model} on {host}", "",
             f"{ceilings.get('date', '')}, {scale.dtype}, bs=1, {scale.decode_tokens} tokens decoded per request.", "",
             "| backend | cached | VRAM GiB | tok/s | bound tok/s | of the bound |", "|---|---|---|---|---|---|"]
    for r in headline_rows(scale, results):
        cached = "all" if r["cache_rate"] is None else f"{100 * r['cache_rate']:g} %"
        lines.append(f"| {r['backend']} | {cached} | {_fmt(r['vram_gib'])} | {_fmt(r['tok_s'])} | "
                     f"{_fmt(r['bound_tok_s'])} | {_fmt(r['bound_ratio'], 2)} |")
    lines += ["", "## Every decode row", "", "| backend | cached | tok/s | TTFT ms | miss rate | bound tok/s | of the bound |",
              "|---|---|---|---|---|---|---|"]
    for r in results["decode"]:
        if not r.get("ok"):
            lines.append(f"| {r['backend']} | {r.get('cache_rate')} | failed: {str(r.get('error', ''))[:80]} | | | | |")
            continue
        cached = "all" if r.get("cache_rate") is None else f"{100 * r['cache_rate']:g} %"
        lines.append(f"| {r['backend']} | {cached} | {_fmt(r['decode_tok_s'])} | {_fmt(r.get('ttft_ms'), 0)} | "
                     f"{_fmt(r.get('miss_rate'), 3)} | {_fmt(r.get('bound_tok_s'))} | {_fmt(r.get('bound_ratio'), 2)} |")
    lines += ["", f"## Under concurrency ({scale.serving_backend}, {100 * scale.serving_cache_rate:g} % cached)", "",
              "| streams | total tok/s | per stream tok/s | TTFT p50 ms | ITL p50 ms | same text as alone |",
              "|---|---|---|---|---|---|"]
    for r in results["serving"]:
        if not r.get("ok"):
            lines.append(f"| failed: {str(r.get('error', ''))[:80]} | | | | | |")
        elif r.get("mode") == "concurrency":
            lines.append(f"| {r['concurrency']} | {_fmt(r['total_tok_s'])} | {_fmt(r['stream_tok_s_mean'])} | "
                         f"{_fmt(r['ttft_ms_p50'], 0)} | {_fmt(r['itl_ms_p50'])} | {_fmt(r.get('matches_solo'), 2)} |")
    lines += ["", f"## Long prompts ({100 * scale.serving_cache_rate:g} % cached)", "",
              "| backend | prompt tokens | TTFT s | prefill tok/s | decode tok/s after | peak GiB |", "|---|---|---|---|---|---|"]
    for r in results.get("long") or []:
        if not r.get("ok") or r.get("errors"):
            lines.append(f"| {r.get('backend')} | {r.get('prompt_tokens', '')} | failed: "
                         f"{str(r.get('error') or r.get('first_error', ''))[:80]} | | | |")
            continue
        lines.append(f"| {r['backend']} | {r['prompt_tokens']} | {_fmt(r['ttft_s'], 3)} | {_fmt(r['prefill_tok_s'], 0)} | "
                     f"{_fmt(r['decode_tok_s'])} | {_fmt(r.get('peak_allocated_gib'))} |")
    lines += ["", f"## By routing ({100 * scale.serving_cache_rate:g} % cached; docs/routing.md)", "",
              "| backend | routing | tok/s | miss rate | bound tok/s | of the bound |", "|---|---|---|---|---|---|"]
    for r in results.get("routing") or []:
        routing = r["model"].rpartition("routing=")[2]
        if not r.get("ok"):
            lines.append(f"| {r['backend']} | {routing} | failed: {str(r.get('error', ''))[:80]} | | | |")
            continue
        lines.append(f"| {r['backend']} | {routing} | {_fmt(r['decode_tok_s'])} | {_fmt(r.get('miss_rate'), 3)} | "
                     f"{_fmt(r.get('bound_tok_s'))} | {_fmt(r.get('bound_ratio'), 2)} |")
    lines += gguf_lines(scale, results)
    lines += ["", "## Ceilings", "", "| ceiling | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(v)} |" for k, v in ceilings.items() if isinstance(v, float)]
    lines += ["", "## Commands", ""]
    lines += [f"    {c}" for cmds in commands.values() for c in cmds]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.suite", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/suite"),
                   help="folder for every output; decode rows are appended to its decode.jsonl (default: %(default)s)")
    p.add_argument("--scale", choices=sorted(SCALES), default="full",
                   help="full: the results page's configurations on a GPU; tiny: the demo model on the CPU "
                        "(default: %(default)s)")
    p.add_argument("--model", help="serve this model instead of the scale's (default: the scale's model)")
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps to run (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600,
                   help="seconds each server may take to load (default: %(default)s)")
    args = p.parse_args(argv)
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        p.error(f"--steps: unknown {', '.join(unknown)} (choose from {', '.join(STEPS)})")
    scale, model = SCALES[args.scale], args.model or SCALES[args.scale].model
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    commands = step_commands(scale, model, out, args.startup_timeout)
    if "ceilings" not in steps and not (out / "ceilings.json").exists():
        for argv_ in commands["decode"] + commands["routing"] + commands["gguf"]:  # no ceilings to bound the rows
            i = argv_.index("--ceilings")
            del argv_[i:i + 2]
    for step in ("decode", "routing", "gguf"):  # bench_decode_moe appends: start this run's rows afresh
        if step in steps:
            (out / f"{step}.jsonl").unlink(missing_ok=True)
    status: dict[str, int | str] = {}
    for step in steps:
        if step == "resident" and scale.device != "cuda":
            status[step] = "skipped: needs CUDA"
            continue
        if step in ("routing", "gguf") and not commands[step]:
            status[step] = "skipped: --model is not synthetic"
            continue
        codes = [run_module(argv_, out / "logs" / f"{step}.txt") for argv_ in commands[step]]
        status[step] = max(codes)
    results = read_rows(out)
    shown = {step: ["python -m " + shlex.join(argv_) for argv_ in commands[step]]
             for step in steps if not isinstance(status[step], str)}
    if results["decode"]:
        from benchmarks.plot_decode import plot_rows

        with contextlib.suppress(ValueError):  # no successful row: no plot, the table says why
            plot_rows(results["decode"], out / "sweep.png", f"{model} ({scale.dtype}, bs=1)")
    if results["routing"]:
        from benchmarks.plot_routing import plot as plot_routing

        plot_routing(results["routing"], out / "routing.png", f"{model} by routing ({scale.dtype}, bs=1)")
    summary = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "scale": args.scale,
               "model": model, "status": status, "commands": shown, "headline": headline_rows(scale, results),
               **results}
    (out / "suite.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "table.md").write_text(markdown(scale, model, results, shown))
    print(f"\nsuite: {out / 'table.md'}, {out / 'suite.json'}; steps: "
          + ", ".join(f"{k} {'ok' if v == 0 else v}" for k, v in status.items()))
    return 0 if all(v == 0 or isinstance(v, str) for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

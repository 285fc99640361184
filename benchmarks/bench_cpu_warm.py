"""How much faster the CPU executor computes experts whose weights are already in its caches.

Groundwork for warming the CPU's caches during the time the GPU alone works (docs/design.md §1): in hybrid
decode the host DRAM is the binding resource and sits idle for ~150 us of every ~600 us layer (attention,
routing; docs/results/history.md runs 11-13). If the executor's workers read the next layer's likely
experts into their caches then, the CPU's part of that layer would run from cache. Whether that can pay
depends on two numbers of the host, both measured here:

  cold   one job of k experts right after the caches were flushed (a STREAM read of --flush-mib)
  warm   the same job again at once: each worker re-reads the rows it read a moment ago

    python -m benchmarks.bench_cpu_warm [--experts-per-job 1,2,4,8] [--json out.json]

The speedup warm/cold at k experts says what a warmed expert saves; the largest k that stays warm says
how many experts the caches hold (per-core L2 and the shared L3, listed from sysfs). Performance lives
here, never in unit tests.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.cpu_executor import CpuExecutor, default_num_threads


def cache_sizes() -> dict[str, str]:
    """CPU 0's caches from sysfs: {"L1d": "48K", "L2": "2048K", "L3": "105M", ...} ({} where unreadable)."""
    out = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = (index / "level").read_text().strip(), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except OSError:
            continue
        out[f"L{level}" + ("d" if kind == "Data" else "i" if kind == "Instruction" else "")] = size
    return out


def job_seconds(ex: CpuExecutor, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> float:
    """Compute time of one job (inputs ready -> output written), as the executor measures it."""
    ex.forward(layer, hidden, ids, weights)
    return ex.last_compute_seconds


def measure(ex: CpuExecutor, banks: ExpertBanks, k: int, reps: int, flush_bytes: int, seed: int) -> dict:
    """Median cold and warm GB/s for jobs of k distinct experts (bs=1, one route per expert)."""
    lb = banks.layers[0]
    D, E = lb.tensors["down"].shape[1], lb.num_experts
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, D, generator=g).to(lb.tensors["down"].dtype)  # [1, D]
    weights = torch.full((1, k), 1.0 / k)  # [1, k]
    cold, warm = [], []
    for _ in range(reps):
        ids = torch.randperm(E, generator=g)[:k].view(1, k)  # [1, k]
        ex.read_bandwidth(flush_bytes, reps=1)  # evicts the experts of the last rep from every cache
        cold.append(job_seconds(ex, 0, hidden, ids, weights))
        warm.append(job_seconds(ex, 0, hidden, ids, weights))
    nbytes = k * banks.expert_nbytes()
    return {"experts": k, "bytes": nbytes, "cold_gbs": nbytes / statistics.median(cold) / 1e9,
            "warm_gbs": nbytes / statistics.median(warm) / 1e9,
            "speedup": statistics.median(cold) / statistics.median(warm)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_cpu_warm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128, help="experts per layer E (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size D (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=768, help="expert intermediate size I (default: %(default)s)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="bank dtype (default: %(default)s)")
    p.add_argument("--experts-per-job", default="1,2,4,8", help="comma list of k (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="executor workers (default: one per physical core but one, as hybrid serving uses)")
    p.add_argument("--reps", type=int, default=9, help="cold/warm pairs per k; medians reported (default: %(default)s)")
    p.add_argument("--flush-mib", type=int, default=1024, help="STREAM read between reps that flushes the caches")
    p.add_argument("--json", help="write the results to this path")
    args = p.parse_args(argv)
    try:
        ks = [int(k) for k in args.experts_per_job.split(",")]
    except ValueError:
        p.error(f"--experts-per-job: expected a comma list of integers, got {args.experts_per_job!r}")
    if not all(0 < k <= args.experts for k in ks):
        p.error(f"--experts-per-job: every k must be in 1..{args.experts} (--experts), got {args.experts_per_job}")
    dtype = getattr(torch, args.dtype)
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 1, args.experts, args.hidden, args.intermediate, dtype)
    for t in banks.layers[0].tensors.values():
        t.normal_(0, 0.02)
    ex = CpuExecutor(banks, num_threads=args.threads or default_num_threads(leave_driver_core=True))
    threads, isa = ex.num_threads, ex.isa
    try:
        rows = [measure(ex, banks, k, args.reps, args.flush_mib << 20, seed=k) for k in ks]
    finally:
        ex.close()
    facts = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "threads": threads, "isa": isa,
             "expert_bytes": banks.expert_nbytes(), "caches": cache_sizes(), "command": " ".join(sys.argv)}
    print(f"{threads} workers ({isa}), expert {banks.expert_nbytes() / 1e6:.2f} MB, caches {facts['caches']}")
    print(f"{'experts':>8} | {'MB':>7} | {'cold GB/s':>9} | {'warm GB/s':>9} | {'warm/cold':>9}")
    for r in rows:
        print(f"{r['experts']:>8} | {r['bytes'] / 1e6:>7.1f} | {r['cold_gbs']:>9.1f} | {r['warm_gbs']:>9.1f} | "
              f"{r['speedup']:>9.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({**facts, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

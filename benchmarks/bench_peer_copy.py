"""Per-layer copy of a decode step's misses with a peer tier (docs/multi-gpu.md): the fused two-source copy
(kernels/peer_copy.py) with every miss on the host, every miss on the peer, and half and half, against the
host-only fused copy (kernels/gather_copy.py) and a linear peer -> home copy of the same bytes.

    python -m benchmarks.bench_peer_copy --peer cuda:1            # a real second GPU (NVLink / PCIe P2P)
    python -m benchmarks.bench_peer_copy --peer cuda:0            # simulated: a second pool on the home GPU
    python -m benchmarks.bench_peer_copy --peer cpu --device cpu --model tiny   # smoke run of the torch path

One layer of the preset's geometry (bf16 on CUDA, fp32 on the CPU); ``--jobs`` misses per step (top-k at
bs=1 by default). Columns: case / jobs / from_peer / us (median per call, CUDA-synchronised) / GB/s (expert
bytes moved over that time). ``peer`` should approach the linear P2P rate, ``host`` the PCIe gather's,
``half`` the larger of the two halves' times (the sources overlap in one launch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls after 3 warm-ups, each call synchronised."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_peer_copy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b", help="geometry preset (default: %(default)s)")
    p.add_argument("--device", default="cuda:0", help="home device (default: %(default)s)")
    p.add_argument("--peer", default="cuda:0", help="peer device; the home device itself simulates one (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=None, help="misses per layer and step (default: the preset's top-k)")
    p.add_argument("--reps", type=int, default=50, help="timed calls per case (default: %(default)s)")
    p.add_argument("--json", default=None, help="append one JSON line per case to this file")
    args = p.parse_args(argv)
    from kernels.gather_copy import CopyPlan, copy_fused, copy_per_bank
    from kernels.peer_copy import copy_tiered_fused, copy_tiered_reference
    from services.engine.moe.peer_cache import enable_peer_access, measure_copy_gbps
    from services.profiler.bench_bw import geometry
    from services.profiler.probes import make_bank

    home, peer = torch.device(args.device), torch.device(args.peer)
    if home.type != peer.type:
        print(f"bench_peer_copy: --device {home} and --peer {peer} must be of one kind", file=sys.stderr)
        return 2
    if home.type == "cuda" and peer.index != home.index:
        enable_peer_access(home.index, peer.index)
    geo = geometry(args.model)
    J = args.jobs or geo.top_k
    E = max(geo.num_experts, 2 * J)
    dtype = torch.bfloat16 if home.type == "cuda" else torch.float32
    bank = make_bank(E, geo.hidden_size, geo.moe_intermediate_size, dtype, pin=home.type == "cuda")
    host = [{"gate_up": bank.gate_up, "down": bank.down}]
    slots = {k: torch.empty((J, *v.shape[1:]), dtype=dtype, device=home) for k, v in host[0].items()}  # [J, ...]
    peer_banks = [{k: torch.zeros((E, *v.shape[1:]), dtype=dtype, device=peer) for k, v in host[0].items()}]
    host_plan, peer_plan = CopyPlan(host, slots), CopyPlan(peer_banks, slots)
    fused = home.type == "cuda"
    job_src = torch.arange(J, dtype=torch.int32, device=home)  # experts 0..J-1 of the layer
    job_dst = torch.arange(J, dtype=torch.int32, device=home)
    job_count = torch.tensor([J], dtype=torch.int32, device=home)
    fetched = torch.zeros(1, dtype=torch.int64, device=home)
    nbytes = J * bank.expert_bytes
    rows = []

    def row(case: str, from_peer: int, seconds: float) -> None:
        rows.append({"case": case, "jobs": J, "from_peer": from_peer, "us": seconds * 1e6, "GBps": nbytes / seconds / 1e9,
                     "home": str(home), "peer": str(peer), "model": args.model, "expert_bytes": bank.expert_bytes})

    plain = (lambda: copy_fused(host_plan, job_src, job_dst, job_count, J)) if fused else \
        (lambda: copy_per_bank(host_plan, job_src, job_dst, job_count))
    row("host-only copy_missing", 0, timed(plain, home, args.reps))
    for case, on_peer in (("host", 0), ("half", J // 2), ("peer", J)):
        table = torch.full((E,), -1, dtype=torch.int32, device=home)
        table[:on_peer] = torch.arange(on_peer, dtype=torch.int32, device=home)  # expert e in peer slot e
        if fused:
            fn = lambda t=table: copy_tiered_fused(host_plan, peer_plan, job_src, job_dst, job_count, t, fetched, J)  # noqa: E731
        else:
            fn = lambda t=table: copy_tiered_reference(host_plan, peer_plan, job_src, job_dst, job_count, t, fetched)  # noqa: E731
        row(case, on_peer, timed(fn, home, args.reps))
    linear = measure_copy_gbps(peer, home, nbytes)
    print(f"{J} misses of {bank.expert_bytes / 2**20:.2f} MiB, home {home}, peer {peer}; linear peer->home copy "
          f"of the same bytes: {linear:.1f} GB/s")
    print(f"{'case':<24}{'from_peer':>10}{'us':>10}{'GB/s':>9}")
    for r in rows:
        print(f"{r['case']:<24}{r['from_peer']:>10}{r['us']:>10.1f}{r['GBps']:>9.1f}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "linear_p2p_GBps": linear}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast the CPU executor streams expert weights, against the host banks' page size and the software
prefetch in its GEMV loop: alone, and beside the PCIe gather that hybrid runs at the same time.

    python -m benchmarks.bench_cpu_stream [--prefetch 2048:l1,4096:l2,0] [--pages huge,small] [--json out.json]
    python -m benchmarks.bench_cpu_stream --pages huge --prefetch 4096:l2 --allocations 8   # placement

``--allocations N`` measures N banks allocated side by side (all alive at once, so each has its own
memory): identical hybrid servers on one H200 host differ by 10-15 % in the executor's read rate for
the whole life of the process, which a spread between allocations here would
trace to where the banks' memory lands (in a VM, for example, which guest pages the host backs with
huge pages).

Why: hybrid's decode time is the CPU's share of each layer's misses read from host DRAM while the GPU
copies the other share over PCIe from the same DRAM. The executor reached 103-108 GB/s alone on the
H200 host where a plain AVX-512 read reached 125, and ~78-90 beside the copy. Two
suspects, both measured here on the engine's own memory and kernels:
  - page size: in 4 KiB pages every 64 cache lines cost a page walk (two-level in a VM) and the L2
    streamer restarts at every page; the banks are now advised to 2 MiB pages;
  - memory-level parallelism: prefetcht0 (l1) holds one of ~16 L1 fill buffers per line in flight,
    prefetcht1 (l2) only an entry of L2's deeper queue (the executor now prefetches 4096:l2).

Per page size one bank of a Qwen3-30B-A3B layer (128 experts, 1.2 GB: larger than L3, ids rotate) in
``banks.host_bank`` memory, pinned in place on CUDA. Per prefetch setting, in rounds (every setting
once, then again, so drift hits all): the executor alone (loop mode: jobs back to back on its threads,
no Python per job), and beside the fused PCIe gather (services/profiler/probes.py, what `tandem bench bw`
measures for the profile). Best and median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from tqdm import tqdm

from services.engine.moe.banks import host_page_report
from services.engine.moe.cpu_executor import STREAM_PREFETCH, build_extension, default_num_threads, stream_prefetch
from services.profiler import probes

PAGES = ("huge", "small")  # banks advised to 2 MiB pages or left to the kernel's default


def allocate(args: argparse.Namespace, pages: str, cuda: bool) -> probes.ExpertBank:
    """One bank of the benchmark's geometry in host memory of the given page size (pinned on CUDA)."""
    return probes.make_bank(args.experts, args.hidden, args.intermediate, torch.bfloat16, pin=cuda,
                            huge_pages=pages == "huge")


def measure(args: argparse.Namespace, pages: str, bank: probes.ExpertBank, cuda: bool, bar: tqdm) -> list[dict]:
    """Rows of one bank: per prefetch setting, the executor alone and beside the gather."""
    page_report = host_page_report([bank.gate_up, bank.down])
    kernel = probes.CpuKernel(bank, args.top_k, args.threads, "executor")
    gather = probes.Gather(bank, args.top_k, 0) if cuda else None
    ext = build_extension()
    samples: dict[str, dict[str, list[float]]] = {s: {"alone": [], "cpu_ov": [], "pcie_ov": []} for s in args.prefetch}
    pcie_alone = []
    try:
        for _ in range(args.rounds):
            for setting in args.prefetch:
                ext.set_stream_prefetch(*stream_prefetch(setting))
                got = samples[setting]
                got["alone"].append(probes.cpu_kernel_bw(kernel, args.seconds))
                if gather is not None:
                    pcie, cpu = probes.concurrent(kernel, gather, args.seconds)
                    got["pcie_ov"].append(pcie)
                    got["cpu_ov"].append(cpu)
                bar.update(1)
            if gather is not None:
                pcie_alone.append(probes.gather_bw(gather, args.seconds))
    finally:
        ext.set_stream_prefetch(*stream_prefetch(STREAM_PREFETCH))
        kernel.close()
    rows = []
    for setting, got in samples.items():
        row = {"pages": pages, "prefetch": setting, "huge_page_share": page_report.get("huge_page_bytes", 0)
               / max(1, page_report.get("bytes", 1))}
        for key, values in got.items():
            if values:
                row[f"{key}_best_gbs"], row[f"{key}_median_gbs"] = max(values), statistics.median(values)
        if pcie_alone:
            row["pcie_alone_median_gbs"] = statistics.median(pcie_alone)
        rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    head = ["pages", "bank", "huge share", "prefetch", "CPU alone best / median", "beside PCIe: CPU + PCIe = sum (median)",
            "PCIe alone"]
    print(" | ".join(head))
    for r in rows:
        conc = (f"{r['cpu_ov_median_gbs']:.1f} + {r['pcie_ov_median_gbs']:.1f} = "
                f"{r['cpu_ov_median_gbs'] + r['pcie_ov_median_gbs']:.1f}") if "cpu_ov_median_gbs" in r else "-"
        pcie = f"{r['pcie_alone_median_gbs']:.1f}" if "pcie_alone_median_gbs" in r else "-"
        print(" | ".join([r["pages"], str(r["allocation"]), f"{r['huge_page_share']:.2f}", r["prefetch"],
                          f"{r['alone_best_gbs']:.1f} / {r['alone_median_gbs']:.1f}", conc, pcie]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefetch", default="2048:l1,4096:l1,2048:l2,4096:l2,8192:l2,0",
                   help="comma-separated stream prefetch settings to compare (the executor uses 4096:l2), 'BYTES:LEVEL' or 0 "
                        "(default: %(default)s)")
    p.add_argument("--pages", default="huge,small", help="host page sizes to compare: huge, small (default: %(default)s)")
    p.add_argument("--experts", type=int, default=128, help="experts in the bank (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts per job (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size D (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=768, help="expert intermediate size I (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="executor workers (default: as the hybrid backend on CUDA, one per physical core but one)")
    p.add_argument("--rounds", type=int, default=3, help="rounds over every setting (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=0.5, help="seconds per measurement (default: %(default)s)")
    p.add_argument("--allocations", type=int, default=1,
                   help="banks per page size, allocated side by side and each measured (default: %(default)s)")
    p.add_argument("--json", default=None, help="write the rows to this path")
    args = p.parse_args(argv)
    if args.allocations < 1:
        p.error(f"--allocations must be at least 1, got {args.allocations}")
    args.prefetch = [s.strip() for s in args.prefetch.split(",") if s.strip()]
    pages = [s.strip() for s in args.pages.split(",") if s.strip()]
    try:
        for setting in args.prefetch:
            stream_prefetch(setting)
        if not pages or any(s not in PAGES for s in pages):
            raise ValueError(f"--pages {args.pages!r}: expected a comma-separated list of {', '.join(PAGES)}")
    except ValueError as exc:
        p.error(str(exc))
    args.threads = args.threads or default_num_threads(leave_driver_core=True)
    cuda = torch.cuda.is_available()
    rows = []
    with tqdm(total=len(pages) * args.allocations * args.rounds * len(args.prefetch), desc="cpu stream",
              unit="trial") as bar:
        for page in pages:
            banks = [allocate(args, page, cuda) for _ in range(args.allocations)]  # alive together: distinct memory
            for i, bank in enumerate(banks):
                rows += [{**row, "allocation": i} for row in measure(args, page, bank, cuda, bar)]
            del banks
    print(f"CPU executor stream · {args.threads} threads · top-{args.top_k} of {args.experts} experts "
          f"({args.hidden}x{args.intermediate}, bf16) · {args.rounds} rounds of {args.seconds} s · GB/s")
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

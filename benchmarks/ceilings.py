"""The physical ceilings of this host for MoE decode: what the hardware moves, measured with plain torch
copies and reductions (none of Tandem's own kernels), so every benchmark number can be set against them.

    python -m benchmarks.ceilings --json ceilings.json        # ~20 s on a GPU host; CPU rows only without CUDA

Keys of the JSON (GB/s unless said; the GPU ones are absent without CUDA):

    h2d_pinned_linear_GBs / d2h_pinned_linear_GBs   one pinned buffer copied to / from the GPU
    h2d_gather_8x9.4MB_GBs                          8 experts of Qwen3-30B-A3B's size (3 x 2048 x 768 bf16),
                                                    one copy_ each from a pinned bank: offload's path
    hbm_copy_rw_GBs                                 a device-to-device copy, bytes read + written
    cpu_read_sum_fp32_GBs                           torch sum over an fp32 buffer on every thread: DRAM read
    overlap_pcie_GBs / overlap_cpu_read_GBs         the linear H2D copy and the CPU sum at the same time:
                                                    both compete for DRAM, as hybrid's two paths do
    launch_us                                       one eager kernel launch from torch
    handoff_us                                      GPU -> CPU -> GPU: a small D2H, event sync, small H2D

`bench_decode_moe --ceilings` reads these keys (offload's bound is the gather, cpu's the CPU read, hybrid's
the concurrent pair), as does `python -m services.profiler.compare`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

GB = 1e9
EXPERT_BYTES = 3 * 2048 * 768 * 2  # one Qwen3-30B-A3B expert in bf16 (gate, up, down): 9.4 MB
GATHER = 8  # experts per token (top-8)


def _median_cuda_s(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``fn`` on the current stream (CUDA events), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _median_cpu_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_ceilings(nbytes: int, reps: int) -> dict:
    x = torch.rand(nbytes // 4, dtype=torch.float32)
    return {"cpu_read_sum_fp32_GBs": nbytes / _median_cpu_s(x.sum, reps) / GB}


def gpu_ceilings(nbytes: int, reps: int, overlap_s: float) -> dict:
    out = {}
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    host.random_(0, 255)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out["h2d_pinned_linear_GBs"] = nbytes / _median_cuda_s(lambda: dev.copy_(host, non_blocking=True), reps) / GB
    out["d2h_pinned_linear_GBs"] = nbytes / _median_cuda_s(lambda: host.copy_(dev, non_blocking=True), reps) / GB

    bank = torch.empty(4 * GATHER, EXPERT_BYTES, dtype=torch.uint8).pin_memory()
    slots = torch.empty(GATHER, EXPERT_BYTES, dtype=torch.uint8, device="cuda")
    picks = torch.randperm(bank.shape[0])[:GATHER].tolist()

    def gather() -> None:
        for slot, expert in enumerate(picks):
            slots[slot].copy_(bank[expert], non_blocking=True)

    out[f"h2d_gather_{GATHER}x9.4MB_GBs"] = GATHER * EXPERT_BYTES / _median_cuda_s(gather, 2 * reps) / GB
    other = torch.empty_like(dev)
    out["hbm_copy_rw_GBs"] = 2 * nbytes / _median_cuda_s(lambda: other.copy_(dev), reps) / GB
    del other, bank, slots

    # Both at once: the linear H2D copy in a loop on this thread, the CPU sum in a loop on another.
    x = torch.rand(nbytes // 4, dtype=torch.float32)
    stop, cpu_bytes = threading.Event(), [0]

    def cpu_loop() -> None:
        while not stop.is_set():
            x.sum()
            cpu_bytes[0] += nbytes

    worker = threading.Thread(target=cpu_loop, daemon=True)
    t0 = time.perf_counter()
    worker.start()
    copied = 0
    while time.perf_counter() - t0 < overlap_s:
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        copied += nbytes
    pcie_s = time.perf_counter() - t0
    stop.set()
    worker.join()
    out["overlap_pcie_GBs"] = copied / pcie_s / GB
    out["overlap_cpu_read_GBs"] = cpu_bytes[0] / (time.perf_counter() - t0) / GB

    small = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    small_host = torch.empty(1, 2048, dtype=torch.bfloat16).pin_memory()

    def handoff() -> None:
        small_host.copy_(small, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        event.synchronize()
        small.copy_(small_host, non_blocking=True)

    n = 200 * reps
    for fn, key in ((handoff, "handoff_us"), (lambda: small.add_(1), "launch_us")):
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        out[key] = (time.perf_counter() - t0) / n * 1e6
    return out


def measure(buffer_mib: int = 2048, reps: int = 10, overlap_s: float = 3.0) -> dict:
    """Every ceiling this host has (module docstring), with the host's description."""
    nbytes = buffer_mib << 20
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_model(),
              "nproc": os.cpu_count(), "torch_threads": torch.get_num_threads(), "buffer_mib": buffer_mib,
              "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    result.update(cpu_ceilings(nbytes, reps))
    if torch.cuda.is_available():
        result.update(gpu_ceilings(nbytes, reps, overlap_s))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ceilings", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--buffer-mib", type=int, default=2048,
                   help="size of the linear buffers; far above the caches (default: %(default)s)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per measure, median kept (default: %(default)s)")
    p.add_argument("--overlap-seconds", type=float, default=3.0,
                   help="how long the concurrent copy + read runs (default: %(default)s)")
    p.add_argument("--json", type=Path, help="write the ceilings to this file")
    args = p.parse_args(argv)
    if args.buffer_mib <= 0 or args.reps <= 0 or args.overlap_seconds <= 0:
        p.error("--buffer-mib, --reps and --overlap-seconds must be positive")
    result = measure(args.buffer_mib, args.reps, args.overlap_seconds)
    for key, value in result.items():
        print(f"{key:28s} {value:.1f}" if isinstance(value, float) else f"{key:28s} {value}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

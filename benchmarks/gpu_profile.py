"""GPU time of a step by kernel, and by kernel family: where a decode (or prefill) step's device time goes.

``kernel_profile(step, steps)`` runs ``step`` ``steps`` times under torch.profiler (CUPTI also sees the
kernels of CUDA-graph replays) and returns one row per kernel name: launches and device microseconds per
step. ``kernel_families(rows)`` sums those rows into the families below (first pattern that matches wins),
with each family's share of the GPU-busy time and, given the step's wall time, of the step.
Shared by bench_resident_decode and bench_hybrid_split; the table is unit-tested with fake profiler events
(tests/benchmarks/test_gpu_profile.py), as CI has no GPU.
"""

from __future__ import annotations

import re

# (family, regex over the kernel name); order matters: the Triton expert kernels before cuBLAS's "gemv"
FAMILIES: list[tuple[str, str]] = [
    ("expert GEMM/GEMV", r"_gate_up|_down_kernel|_combine_kernel|_gemv_kernel|_count_kernel|_place_kernel|moe"),
    ("expert staging (hybrid/offload)", r"_copy_jobs|_wait_add|_ensure_experts|_split_misses|_stage_signal"
                                        r"|_copy_tiered|_pick_kernel|_on_kernels"),
    ("attention", r"attention|flash|fmha|sdpa|softmax_warp"),
    ("norms + rope", r"rms_norm|qk_norm_rope|layer_norm|rotary"),
    ("router/top-k", r"route_topk|topk|sort"),
    ("dense matmul (cuBLAS)", r"nvjet|gemm|cublas|cutlass|xmma|splitKreduce|gemv|sm90_"),
    ("copies", r"copy|memcpy|memset|Memcpy|Memset|fill|cat_|index|gather|scatter"),
]
OTHER = "other"


def family_of(kernel: str) -> str:
    for name, pattern in FAMILIES:
        if re.search(pattern, kernel):
            return name
    return OTHER


def kernel_rows(events, steps: int, top: int | None = None) -> list[dict]:
    """profiler ``key_averages()`` events (``key``, ``count``, ``self_device_time_total`` in us, or
    ``self_cuda_time_total`` on older torch) -> per kernel with device time: launches and us per step, by
    time, the ``top`` first (None: all)."""
    rows = []
    for e in events:
        us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": e.key[:90], "per_step": e.count / steps, "us_per_step": us / steps,
                         "us_each": us / e.count})
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows if top is None else rows[:top]


def kernel_profile(step, steps: int, top: int | None = 20) -> list[dict]:
    """The GPU kernels of ``steps`` calls of ``step`` (``kernel_rows``; synchronizes at the end)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return kernel_rows(prof.key_averages(), steps, top)


def kernel_families(rows: list[dict], wall_us: float | None = None) -> dict:
    """``kernel_rows`` (all kernels) -> {"families": [{family, us_per_step, launches_per_step, share_of_busy,
    share_of_step}], "gpu_busy_us", "wall_us", "idle_us"}: families by time; ``share_of_step`` and the idle
    time (wall - busy: launch gaps, host work, syncs) only with the step's ``wall_us``."""
    sums: dict[str, list[float]] = {}
    for r in rows:
        acc = sums.setdefault(family_of(r["kernel"]), [0.0, 0.0])
        acc[0] += r["us_per_step"]
        acc[1] += r["per_step"]
    busy = sum(us for us, _ in sums.values())
    fams = [{"family": f, "us_per_step": us, "launches_per_step": n, "share_of_busy": us / busy if busy else 0.0,
             "share_of_step": us / wall_us if wall_us else None}
            for f, (us, n) in sorted(sums.items(), key=lambda kv: -kv[1][0])]
    return {"families": fams, "gpu_busy_us": busy, "wall_us": wall_us,
            "idle_us": wall_us - busy if wall_us else None}


def format_families(title: str, table: dict) -> str:
    """The family table as text: us/step, launches, share of busy and of the step; then busy vs wall."""
    lines = [title, f"{'us/step':>9} {'launches':>9} {'of busy':>8} {'of step':>8}  family"]
    for f in table["families"]:
        of_step = f"{f['share_of_step']:>8.1%}" if f["share_of_step"] is not None else f"{'-':>8}"
        lines.append(f"{f['us_per_step']:>9.0f} {f['launches_per_step']:>9.1f} {f['share_of_busy']:>8.1%} "
                     f"{of_step}  {f['family']}")
    busy, wall = table["gpu_busy_us"], table["wall_us"]
    tail = f" of {wall:.0f} us wall ({busy / wall:.0%}; idle {wall - busy:.0f} us)" if wall else ""
    lines.append(f"GPU busy {busy:.0f} us/step{tail}")
    return "\n".join(lines)


def format_kernels(rows: list[dict]) -> str:
    lines = [f"{'us/step':>9} {'launches':>9} {'us each':>8}  kernel"]
    lines += [f"{k['us_per_step']:>9.0f} {k['per_step']:>9.1f} {k['us_each']:>8.1f}  {k['kernel']}" for k in rows]
    return "\n".join(lines)

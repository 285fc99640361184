"""Side by side: a `tandem bench bw` profile and the physical ceilings that `python -m benchmarks.ceilings`
measured on the same host, so each number we use has its hardware bound next to it.

    python -m services.profiler.compare PROFILE.json ceilings.json [--dtype bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from services.common.profiles import read_profile

# (what, profile getter, ceilings keys: the first present is the bound; the C keys are in older rows only)
ROWS = (
    ("CPU DRAM read", lambda p, k: p.ceilings.cpu_read, ("c_avx512_stream_read_GBs", "cpu_read_sum_fp32_GBs")),
    ("H2D linear pinned", lambda p, k: p.ceilings.h2d, ("h2d_pinned_linear_GBs",)),
    ("D2H linear pinned", lambda p, k: p.ceilings.d2h, ("d2h_pinned_linear_GBs",)),
    ("CPU expert GEMV bs1", lambda p, k: p.kernels[k].cpu_executor_bs1,
     ("c_avx512_gemv_bf16_8experts_GBs", "cpu_gemv_bfloat16_GBs")),
    ("PCIe expert gather", lambda p, k: p.kernels[k].pcie_gather, ("h2d_gather_8x9.4MB_GBs",)),
    ("concurrent: PCIe", lambda p, k: p.concurrent[k].pcie_ov if k in p.concurrent else None, ("overlap_pcie_GBs",)),
    ("concurrent: CPU", lambda p, k: p.concurrent[k].cpu_ov if k in p.concurrent else None, ("overlap_cpu_read_GBs",)),
)


def compare(profile_path: str | Path, ceilings_path: str | Path, dtype: str = "bfloat16") -> list[dict]:
    """One row per quantity: ours (GB/s), the ceiling (GB/s, key) and ours / bound."""
    profile = read_profile(profile_path)
    limits = json.loads(Path(ceilings_path).read_text())
    rows = []
    for what, get, keys in ROWS:
        ours = get(profile, dtype)
        key = next((k for k in keys if isinstance(limits.get(k), (int, float))), None)
        bound = limits.get(key) if key else None
        rows.append({"what": what, "ours": ours, "bound": bound, "bound_key": key,
                     "ratio": ours / bound if ours and bound else None})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.profiler.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="a profile JSON written by `tandem bench bw`")
    p.add_argument("ceilings", help="the same host's ceilings JSON (python -m benchmarks.ceilings)")
    p.add_argument("--dtype", default="bfloat16", help="expert format of the profile to compare (default: %(default)s)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = compare(args.profile, args.ceilings, args.dtype)
    fmt = lambda v: f"{v:8.1f}" if isinstance(v, (int, float)) else "       -"  # noqa: E731
    print(f"{'quantity':<22}{'ours GB/s':>10}{'bound':>9}{'ours/bound':>11}  bound from")
    for r in rows:
        ratio = f"{r['ratio']:10.2f}" if r["ratio"] else "         -"
        print(f"{r['what']:<22}{fmt(r['ours']):>10}{fmt(r['bound']):>9} {ratio}  {r['bound_key'] or '-'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

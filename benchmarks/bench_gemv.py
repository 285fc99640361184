"""The decode step's small matmuls (one row): cuBLAS against kernels/gemv.py over a sweep of its blocks.

Each call is timed the way decode runs it, replayed from a CUDA graph (``--calls`` calls captured back to
back, best of ``--replays`` replays, divided by the calls), so launch overhead counts as it does there.
Shapes default to Qwen3-30B-A3B's q/k/v, o_proj and router; every Triton result is checked against
gemv_ref first.

    python -m benchmarks.bench_gemv [--shapes 2048x5120,4096x2048,2048x128] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from tqdm import tqdm

from kernels.gemv import gemv, gemv_ref, pick_blocks

DEFAULT_SHAPES = "2048x5120,4096x2048,2048x128"  # K x N: qkv, o_proj, router of Qwen3-30B-A3B
BLOCKS = list(itertools.product((1, 2, 4, 8), (256, 512, 1024), (2, 4, 8)))  # BLOCK_N, BLOCK_K, num_warps


def graph_us(fn, calls: int, replays: int) -> float:
    """Microseconds per call of ``fn`` (no arguments), ``calls`` of them captured in one CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of KxN (input x output features)")
    p.add_argument("--calls", type=int, default=50, help="calls captured per CUDA graph")
    p.add_argument("--replays", type=int, default=20, help="graph replays; the best is kept")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv: needs a CUDA device", file=sys.stderr)
        return 2
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    except ValueError:
        p.error(f"--shapes: expected a comma list of KxN, got {args.shapes!r}")
    rows = []
    for K, N in shapes:
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
        want = gemv_ref(x, w)
        cublas = graph_us(lambda: torch.nn.functional.linear(x, w), args.calls, args.replays)
        timed = {}
        for blocks in tqdm(BLOCKS, desc=f"{K}x{N}", file=sys.stderr):
            got = gemv(x, w, blocks=blocks)
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 output rounding
            timed[blocks] = graph_us(lambda b=blocks: gemv(x, w, blocks=b), args.calls, args.replays)
        best = min(timed, key=timed.get)
        chosen = pick_blocks(N, K)
        gb = N * K * 2 / 1e3  # bytes of weight / 1e3: GB/s when divided by microseconds
        rows.append({"K": K, "N": N, "cublas_us": cublas, "best_blocks": best, "best_us": timed[best],
                     "chosen_blocks": chosen, "chosen_us": timed.get(chosen), "cublas_GBs": gb / cublas,
                     "best_GBs": gb / timed[best], "all_us": {"x".join(map(str, b)): t for b, t in timed.items()}})
    print(f"{'K x N':>12} | {'cuBLAS us':>9} | {'GB/s':>6} | {'best us':>8} | {'GB/s':>6} | {'best blocks':>14} | "
          f"{'chosen us':>9} | chosen blocks")
    for r in rows:
        print(f"{r['K']:>5} x {r['N']:<5} | {r['cublas_us']:9.2f} | {r['cublas_GBs']:6.0f} | {r['best_us']:8.2f} | "
              f"{r['best_GBs']:6.0f} | {str(r['best_blocks']):>14} | {r['chosen_us'] or float('nan'):9.2f} | "
              f"{r['chosen_blocks']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2,
                      default=list)
    return 0


if __name__ == "__main__":
    sys.exit(main())

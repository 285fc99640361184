"""The CPU executor's GGUF GEMV kernels alone, on the calling thread: GB/s of block bytes per type, ISA and
input kind (int8 inputs: a bf16 model's; fp32 inputs: an fp32 model's).

The default shape is llama.cpp's own CPU benchmark case, ``test-backend-ops perf -o MUL_MAT`` with m=4096,
n=1, k=14336 (33–62 MB of blocks: streamed from DRAM), so its us/run compare directly with ggml's kernels on
the same core (``taskset -c 0 test-backend-ops perf -b CPU -o MUL_MAT -p 'type_a=q4_K,type_b=f32,m=4096,n=1,
k=14336'``). Every kernel's output is checked against the torch reference first (gguf_quant.dequantize, and
q8_inputs for int8 inputs); timing wrong code means nothing.

    python -m benchmarks.bench_gguf_gemv_cpu [--types q4_K,q5_K,q6_K,q8_0,mxfp4_gguf] [--rows 4096 --cols 14336]
        [--isa avx512bf16,avx2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from services.engine.moe.cpu_executor import build_extension
from services.engine.moe.gguf_quant import KERNEL_CODE, GGUFType, dequantize, q8_inputs, quantize

POOL_ROWS = 256  # distinct rows quantized, then tiled to --rows (quantizing 4096 x 14336 takes minutes)


def time_us(fn, rounds: int, calls: int) -> float:
    """Best of ``rounds`` of ``calls`` back-to-back calls, microseconds per call."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="q4_K,q5_K,q6_K,q8_0,mxfp4_gguf", help="GGUF types (default: %(default)s)")
    p.add_argument("--rows", type=int, default=4096, help="weight rows m (default: %(default)s)")
    p.add_argument("--cols", type=int, default=14336, help="values per row k, a multiple of 256 (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=1, help="input vectors n (default: %(default)s)")
    p.add_argument("--isa", default="avx512bf16,avx2", help="ISAs to time, those this CPU has (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds, the best kept (default: %(default)s)")
    p.add_argument("--calls", type=int, default=10, help="calls per round (default: %(default)s)")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    try:
        types = [GGUFType(t) for t in args.types.split(",")]
    except ValueError as e:
        p.error(f"--types: {e}; expected some of {', '.join(t.value for t in GGUFType)}")
    if args.cols % 256:
        p.error(f"--cols {args.cols} is not a multiple of 256 (a K-quant block)")
    ext = build_extension()
    isas = [isa for isa in args.isa.split(",") if ext.select_isa(isa)]
    g = torch.Generator().manual_seed(0)
    X = torch.randn(args.tokens, args.cols, generator=g)
    rows = []
    for qtype in types:
        pool = quantize(torch.randn(min(POOL_ROWS, args.rows), args.cols, generator=g) / args.cols ** 0.5, qtype)
        W = pool.repeat(-(-args.rows // pool.shape[0]), 1)[:args.rows].contiguous()  # [rows, row bytes]
        dense = dequantize(pool, qtype, args.cols)
        for isa in isas:
            for q8 in (True, False) if isa != "scalar" else (False,):  # scalar: fp32 only
                run = lambda: ext.gemv_gguf(isa, W, KERNEL_CODE[qtype], X, q8)  # noqa: E731
                ref = (q8_inputs(X) if q8 else X) @ dense.T
                err = ((run()[:, :pool.shape[0]] - ref).abs().max() / ref.abs().max()).item()
                if not err <= 1e-5:
                    raise RuntimeError(f"{qtype.value} {isa} {'int8' if q8 else 'fp32'} inputs: max relative error "
                                       f"{err:.3g} against the reference")
                us = time_us(run, args.rounds, args.calls)
                rows.append({"type": qtype.value, "isa": isa, "inputs": "int8" if q8 else "fp32",
                             "m": args.rows, "n": args.tokens, "k": args.cols, "us_per_run": us,
                             "gb_per_s": W.numel() / us / 1e3, "max_rel_err": err})
                print(f"{qtype.value:>10} {isa:>10} {rows[-1]['inputs']:>4} inputs  {us:9.0f} us/run  "
                      f"{rows[-1]['gb_per_s']:6.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

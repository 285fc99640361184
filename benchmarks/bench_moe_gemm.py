"""The routed experts of one layer on the GPU: the Triton GEMV (kernels/moe_gemv.py, an expert read per route)
against the grouped GEMM (kernels/moe_gemm.py, an expert read per tile of routes), by tokens per step.

What counts is the bytes of the DISTINCT experts a step routes to (what any kernel must read at least once):
each row reports them as GB/s of distinct expert bytes, next to the HBM ceiling measured in the same run (a
device-to-device copy, bytes read + written, like benchmarks/ceilings.py). A kernel at the ceiling reads
each distinct expert once at HBM speed; the GEMV falls below it as soon as routes share experts.

Each call is timed as decode runs it, replayed from a CUDA graph (``--calls`` captured back to back, best of
``--replays``), prefill-sized steps too (the same kernels run eagerly there). Routing:
top-k of E uniformly at random per token (the synthetic models' routers); every result is checked against
moe_reference in fp32 first (fp8: on the dequantized experts). ``--sweep`` times every candidate launch
config of the GEMM per size and prints the best: what goes into kernels/moe_gemm.CONFIGS for a device.
``--gemv-sweep`` (GGUF banks) instead times the GEMV at each candidate launch of its two kernels (rows per
program x num_warps; kernel 1 swept with kernel 2 at the table's launch, then kernel 2 beside kernel 1's best)
at a few small token counts: what goes into kernels/moe_gemv.GGUF_LAUNCH for the banks' types.

    python -m benchmarks.bench_moe_gemm [--tokens 1,4,8,16,32,64,256] [--fp8 | --mxfp4 | --gguf TYPES] [--gpt-oss]
        [--sweep | --gemv-sweep] [--json out.json]

    # a Q4_K_M file's layer of Qwen3-30B-A3B: gate_up q4_K, down q6_K (GB/s of the blocks' bytes)
    python -m benchmarks.bench_moe_gemm --gguf q4_K+q6_K

    # the GGUF GEMV's launches for that layer, at 1, 2, 4 and 8 tokens
    python -m benchmarks.bench_moe_gemm --gguf q4_K+q6_K --gemv-sweep --json gemv_sweep.json

    # gpt-oss-120b's layer: MXFP4 experts, biases and the clamped SwiGLU, top-4 of 128
    python -m benchmarks.bench_moe_gemm --mxfp4 --gpt-oss --experts 128 --top-k 4 --hidden 2880 --inter 2880
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
from tqdm import tqdm

from benchmarks.bench_gemv import graph_us
from kernels.moe_gemm import GemmConfig, moe_gemm, pick_config
from kernels.moe_gemv import GGUF_LAUNCH, RowLaunch, moe_gemv
from services.engine.models import mxfp4
from services.engine.moe import gguf_quant
from services.engine.moe.fp8 import dequantize, dequantize_gate_up, quantize, quantize_gate_up
from services.engine.moe.reference import ClampedSwiGLU, moe_reference

GB = 1e9


def sweep_configs() -> list[GemmConfig]:
    """Candidate launch configs for --sweep (block_k dividing 128, so fp8 can use each)."""
    out = []
    for bm, bn, bk, warps in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8)):
        out.append(GemmConfig(bm, bn, bk, max(bn, 64), bk, num_warps=warps, num_stages=3))
    return out


def gemv_launch_candidates() -> list[RowLaunch]:
    """Candidate launches of each GGUF GEMV kernel for --gemv-sweep: rows per program x num_warps."""
    return [RowLaunch(rows, warps) for rows, warps in itertools.product((8, 16, 32, 64), (2, 4, 8))]


def sweep_gemv_launches(gemv, check, tokens: int, gguf_types, nbytes: int, calls: int, replays: int) -> list[dict]:
    """``gemv(launch)`` (moe_gemv with gguf_launch=launch, checked by ``check(out)``) timed with kernel 1 at each
    candidate and kernel 2 at the table's launch, then kernel 2 at each candidate beside kernel 1's best -> rows
    (tokens, kernel, its bank's type, rows, num_warps, us and GB/s of ``nbytes`` for the whole call)."""
    table = (GGUF_LAUNCH[gguf_types[0]][0], GGUF_LAUNCH[gguf_types[1]][1])
    rows, best1 = [], table[0]
    for kernel, gguf_type in ((0, gguf_types[0]), (1, gguf_types[1])):
        timed = {}
        for cand in gemv_launch_candidates():
            launch = (cand, table[1]) if kernel == 0 else (best1, cand)
            try:
                check(gemv(launch))
                timed[cand] = graph_us(lambda lc=launch: gemv(lc), calls, replays)
            except Exception as exc:  # noqa: BLE001 - a launch the device cannot run (registers): skipped
                print(f"  {('gate_up', 'down')[kernel]} {cand}: {type(exc).__name__}: {exc}", file=sys.stderr)
        for cand, us in timed.items():
            rows.append({"tokens": tokens, "kernel": ("gate_up", "down")[kernel], "gguf_type": gguf_type.value,
                         "rows": cand.rows, "num_warps": cand.num_warps, "table": cand == table[kernel],
                         "us": us, "GBs": nbytes / (us * 1e-6) / GB})
        if kernel == 0 and timed:
            best1 = min(timed, key=timed.get)
    return rows


def print_gemv_sweep(rows: list[dict]) -> None:
    """The --gemv-sweep table, the best launch of each kernel per token count marked *, the table's marked t."""
    print(f"{'T':>3} | {'kernel':>7} | {'type':>10} | {'rows':>4} | {'warps':>5} | {'GEMV us':>8} | {'GB/s':>6} |")
    for (tokens, kernel), group in itertools.groupby(rows, key=lambda r: (r["tokens"], r["kernel"])):
        group = list(group)
        best = min(group, key=lambda r: r["us"])
        for r in group:
            mark = ("*" if r is best else "") + ("t" if r["table"] else "")
            print(f"{tokens:>3} | {kernel:>7} | {r['gguf_type']:>10} | {r['rows']:>4} | {r['num_warps']:>5} | "
                  f"{r['us']:8.1f} | {r['GBs']:6.0f} | {mark}")
    print("best per token count (kernel: rows, num_warps): GGUF_LAUNCH[type] = (gate_up's, down's)")
    for tokens, group in itertools.groupby(rows, key=lambda r: r["tokens"]):
        group = list(group)
        picks = []
        for kernel in ("gate_up", "down"):
            mine = [r for r in group if r["kernel"] == kernel]
            if mine:
                b = min(mine, key=lambda r: r["us"])
                picks.append(f"{kernel} ({b['gguf_type']}): RowLaunch({b['rows']}, {b['num_warps']}) {b['us']:.1f} us")
        print(f"  T={tokens}: " + "; ".join(picks))


def print_gemv_against_gemm(rows: list[dict], ceiling: float, sweep: bool) -> None:
    print(f"{'T':>5} | {'routes':>6} | {'experts':>7} | {'GEMV us':>8} | {'GB/s':>6} | {'GEMM us':>8} | {'GB/s':>6} | "
          f"{'% ceil':>6}" + (" | best us | best config" if sweep else ""))
    for r in rows:
        line = (f"{r['tokens']:>5} | {r['routes']:>6} | {r['distinct_experts']:>7} | {r['gemv_us']:8.1f} | "
                f"{r['gemv_GBs']:6.0f} | {r['gemm_us']:8.1f} | {r['gemm_GBs']:6.0f} | "
                f"{100 * r['gemm_GBs'] / ceiling:5.0f}%")
        if sweep:
            line += f" | {r['best_us']:7.1f} | {r['best_config']}"
        print(line)


def hbm_ceiling_GBs(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """A device-to-device copy's bytes read + written per second (best of ``reps``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = graph_us(lambda: dst.copy_(src), 1, reps)
    del src, dst
    return 2 * nbytes / (best * 1e-6) / GB


GGUF_POOL = 8  # distinct GGUF experts quantized; the bank repeats them at distinct addresses (caches see E experts)


def make_gguf_experts(E: int, D: int, I: int, types: tuple, g: torch.Generator) -> dict:
    """GGUF banks gate_up [E, 2I, row_bytes(D)], down [E, D, row_bytes(I)] on the GPU: GGUF_POOL experts
    quantized (gguf_quant.quantize: K-quants on the GPU, q8_0 / mxfp4 by gguf-py on the host), copied to fill E."""
    n = min(E, GGUF_POOL)
    dev = "cuda" if all(t in (gguf_quant.GGUFType.Q4_K, gguf_quant.GGUFType.Q5_K, gguf_quant.GGUFType.Q6_K)
                        for t in types) else "cpu"
    gate_up = gguf_quant.quantize((torch.randn(n, 2 * I, D, generator=g) / D ** 0.5).to(dev), types[0]).cuda()
    down = gguf_quant.quantize((torch.randn(n, D, I, generator=g) / I ** 0.5).to(dev), types[1]).cuda()
    pick = torch.arange(E, device="cuda") % n
    return {"gate_up": gate_up[pick].contiguous(), "down": down[pick].contiguous()}


def make_experts(E: int, D: int, I: int, fmt: str, g: torch.Generator) -> dict:
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    if fmt == "bf16":
        return {"gate_up": gate_up.to("cuda", torch.bfloat16), "down": down.to("cuda", torch.bfloat16)}
    if fmt == "mxfp4":  # the bank layout: [rows, cols/2] bytes, [rows, cols/32] E8M0
        (bg, sg), (bd, sd) = mxfp4.quantize(gate_up), mxfp4.quantize(down)
        return {"gate_up": bg.reshape(E, 2 * I, D // 2).cuda(), "down": bd.reshape(E, D, I // 2).cuda(),
                "gate_up_scale": sg.cuda(), "down_scale": sd.cuda()}
    (qg, sg), (qd, sd) = quantize_gate_up(gate_up), quantize(down)
    return {"gate_up": qg.cuda(), "down": qd.cuda(), "gate_up_scale": sg.cuda(), "down_scale": sd.cuda()}


def dense_fp32(banks: dict, gguf_types=None) -> tuple[torch.Tensor, torch.Tensor]:
    if gguf_types is not None:
        return gguf_quant.dense_experts(banks["gate_up"], banks["down"], *gguf_types, torch.float32)
    if banks["gate_up"].dtype == torch.uint8:  # mxfp4
        unpack = [(banks[w], banks[f"{w}_scale"]) for w in ("gate_up", "down")]
        return tuple(mxfp4.dequantize(q.reshape(*q.shape[:2], -1, 16), s, torch.float32) for q, s in unpack)
    if "gate_up_scale" in banks:
        return (dequantize_gate_up(banks["gate_up"], banks["gate_up_scale"]),
                dequantize(banks["down"], banks["down_scale"]))
    return banks["gate_up"].float(), banks["down"].float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", help="comma list of tokens per step (default 1,4,8,16,32,64,256; with --gemv-sweep "
                                    "1,2,4,8)")
    p.add_argument("--experts", type=int, default=128, help="E (default: Qwen3-30B-A3B's 128)")
    p.add_argument("--top-k", type=int, default=8, help="A (default: 8)")
    p.add_argument("--hidden", type=int, default=2048, help="D (default: 2048)")
    p.add_argument("--inter", type=int, default=768, help="I (default: 768)")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--fp8", action="store_true", help="fp8_block experts (128x128 block scales) instead of bf16")
    fmt.add_argument("--mxfp4", action="store_true", help="MXFP4 experts (gpt-oss's packed e2m1 + E8M0 per 32) "
                                                         "instead of bf16; D and I multiples of 32")
    fmt.add_argument("--gguf", metavar="TYPES", help="GGUF experts: one type for both banks or gate_up+down, "
                                                    "of q4_K, q5_K, q6_K, q8_0, mxfp4_gguf (e.g. q4_K+q6_K)")
    p.add_argument("--gpt-oss", action="store_true", help="gpt-oss expert maths: per-expert biases and the clamped "
                                                         "SwiGLU (alpha 1.702, limit 7)")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", action="store_true", help="also time every candidate GEMM launch config per size")
    sweep.add_argument("--gemv-sweep", action="store_true", help="GGUF banks: time the GEMV at every candidate launch "
                                                               "(rows per program x num_warps) of each kernel instead")
    p.add_argument("--calls", type=int, default=20, help="calls captured per CUDA graph")
    p.add_argument("--replays", type=int, default=10, help="graph replays; the best is kept")
    p.add_argument("--json", help="write the rows to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe_gemm: needs a CUDA device", file=sys.stderr)
        return 2
    if args.gemv_sweep and not args.gguf:
        p.error("--gemv-sweep: the GGUF GEMV's launches; name the banks' types with --gguf")
    if args.tokens is None:
        args.tokens = "1,2,4,8" if args.gemv_sweep else "1,4,8,16,32,64,256"
    try:
        token_counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        p.error(f"--tokens: expected a comma list of integers, got {args.tokens!r}")
    E, A, D, I = args.experts, args.top_k, args.hidden, args.inter
    fmt_name = "fp8_block" if args.fp8 else "mxfp4" if args.mxfp4 else args.gguf if args.gguf else "bf16"
    if args.mxfp4 and (D % 32 or I % 32):
        p.error(f"--mxfp4: --hidden ({D}) and --inter ({I}) must be multiples of 32")
    gguf_types = gguf_quant.format_types(args.gguf) if args.gguf else None
    if args.gguf and gguf_types is None:
        p.error(f"--gguf: expected a type or gate_up+down of {', '.join(t.value for t in gguf_quant.GGUFType)}, "
                f"got {args.gguf!r}")
    g = torch.Generator().manual_seed(0)
    if gguf_types is not None:
        try:
            gguf_quant.row_bytes(gguf_types[0], D), gguf_quant.row_bytes(gguf_types[1], I)
        except ValueError as e:
            p.error(f"--gguf: {e}")
        banks = make_gguf_experts(E, D, I, gguf_types, g)
    else:
        banks = make_experts(E, D, I, "bf16" if fmt_name == "bf16" else "fp8" if args.fp8 else "mxfp4", g)
    expert_bytes = sum(t[0].numel() * t.element_size() for t in banks.values())
    dense = dense_fp32(banks, gguf_types)
    act = ClampedSwiGLU() if args.gpt_oss else None
    bias = ((torch.randn(E, 2 * I, generator=g).to("cuda", torch.bfloat16),
             torch.randn(E, D, generator=g).to("cuda", torch.bfloat16)) if args.gpt_oss else None)
    bias32 = None if bias is None else tuple(b.float() for b in bias)
    ceiling = hbm_ceiling_GBs()
    kw = {k: v for k, v in banks.items() if k.endswith("_scale")}
    if gguf_types is not None:
        kw["gguf_types"] = gguf_types
    rows = []
    for T in tqdm(token_counts, desc="tokens per step", file=sys.stderr):
        hidden = torch.randn(T, D, generator=g).to("cuda", torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]).cuda()
        weights = torch.rand(T, A, generator=g).cuda()
        distinct = int(torch.unique(ids).numel())
        ref = moe_reference(hidden.float(), ids, weights, *dense, act, bias32)

        def gemv(launch=None):
            return moe_gemv(hidden, ids, weights, banks["gate_up"], banks["down"], act=act, bias=bias,
                            gguf_launch=launch, **kw)

        def check(out, name="gemv"):  # bf16 rounding: relative to the output's scale
            err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                raise AssertionError(f"{name} at {T} tokens: max error {err:.3g} of the output's scale")

        if args.gemv_sweep:
            rows += sweep_gemv_launches(gemv, check, T, gguf_types, distinct * expert_bytes, args.calls, args.replays)
            continue

        def gemm(cfg=None):
            return moe_gemm(hidden, ids, weights, banks["gate_up"], banks["down"], act, bias, config=cfg, **kw)

        for name, fn in (("gemv", gemv), ("gemm", gemm)):
            check(fn(), name)
        gemv_us, gemm_us = (graph_us(fn, args.calls, args.replays) for fn in (gemv, gemm))
        row = {"tokens": T, "routes": T * A, "distinct_experts": distinct,
               "distinct_GB": distinct * expert_bytes / GB, "gemv_us": gemv_us, "gemm_us": gemm_us,
               "gemv_GBs": distinct * expert_bytes / (gemv_us * 1e-6) / GB,
               "gemm_GBs": distinct * expert_bytes / (gemm_us * 1e-6) / GB,
               "gemm_config": vars(pick_config(T * A, E, hidden.device))}
        if args.sweep:
            timed = {}
            for cfg in sweep_configs():
                try:
                    timed[cfg] = graph_us(lambda c=cfg: gemm(c), args.calls, args.replays)
                except Exception as exc:  # noqa: BLE001 - a config over the shared-memory limit: skipped
                    print(f"  {cfg}: {type(exc).__name__}", file=sys.stderr)
            best = min(timed, key=timed.get)
            row.update(best_us=timed[best], best_config=vars(best),
                       best_GBs=distinct * expert_bytes / (timed[best] * 1e-6) / GB)
        rows.append(row)
    print(f"E={E} top-{A} D={D} I={I} {fmt_name}{' gpt-oss' if args.gpt_oss else ''}: {expert_bytes / 1e6:.1f} MB per "
          f"expert; HBM ceiling (copy, read + write) {ceiling:.0f} GB/s")
    if args.gemv_sweep:
        print_gemv_sweep(rows)
    else:
        print_gemv_against_gemm(rows, ceiling, args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "hbm_GBs": ceiling,
                       "expert_bytes": expert_bytes, "rows": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())

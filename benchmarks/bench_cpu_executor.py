"""CPU MoE executor at bs=1 against the CPU's DRAM read ceiling, both measured in this run.

Geometry (defaults): Qwen3-30B-A3B experts (D=2048, I=768, bf16, 9.4 MB each; --dtype fp8: 4.7 MB), top-8 of 128, one
layer's bank per `--layers` rotated so no expert is re-read from cache. `--dtype mxfp4` is gpt-oss's
format (packed e2m1 + E8M0 per 32, with its biases and clamped SwiGLU); give it gpt-oss-120b's geometry:
`--dtype mxfp4 --hidden 2880 --intermediate 2880 --top-k 4 --experts 128` (13.1 MB per expert, ~4.25
bits per weight); GB/s then counts MXFP4 bytes (packed values + scales) against the same read ceiling. A GGUF
format (`--dtype q4_K`, `--dtype q4_K+q6_K`: gate_up+down, a Q4_K_M file's mix; q5_K, q6_K, q8_0, mxfp4_gguf)
takes the blocks' bytes (scales inside) the same way. Rounds interleave a read trial
(STREAM-style sum by the executor's own pinned pool) and a GEMV trial, so a noisy neighbour hits both;
the best trial of each is reported. Target: executor >= 80% of the read ceiling (issue 4).
With CUDA: c_sync = the fixed per-layer cost of submit + sync through pinned buffers (DeviceHandoff),
measured as a layer loop with an empty CPU job minus the same loop without the handoff: the driver
fast path (c_sync_s), the old torch-copy path (c_sync_torch_s) and graph mode (c_sync_graph_s).

    python -m benchmarks.bench_cpu_executor [--threads N] [--json out.json]

What changed (handoff rework) and what to expect on the H200 host (16 cores, 15 workers):

  measure                          before     predicted   why
  executor GEMV bs=1 (GB/s)        85.2       ~85         GEMV kernels unchanged
  c_sync eager (us/layer)          123        30-50       one C++ call per submit/sync: 4 driver D2H
                                                          copies (inputs + an 8-byte flag copied from a
                                                          device ring, no fill kernel), 1 H2D; no torch
                                                          op, no pinned-memory event record; empty CPU
                                                          jobs take 1 barrier instead of 3; what is left
                                                          is ~5 driver calls + the GPU->CPU->GPU latency
                                                          (~14 us floor) + the add kernel (~12 us here)
  c_sync eager, torch path (us)    123        ~115        the old path (fast=False), for comparison
  c_sync graph mode (us/layer)     533        15-30       the poller thread is gone (worker 0 polls):
                                                          it was a 17th spinning thread on 16 cores
                                                          (15 workers + the driver thread in sync);
                                                          inputs staged by the signal kernel itself
                                                          (1 kernel node, not 3 copy nodes + 1);
                                                          if it stays > eager, eager stays the default
  bench bw cpu_ov (GB/s)           16.3       70-80       executor loop mode (no Python/GIL per job) on
                                                          cores-1 workers, bytes counted over the copy
                                                          loop's own window (ceilings overlap: 81)
  bench bw c_sync (us)             529        30-50       = this file's eager c_sync (was a round trip
                                                          with 16 workers + the driver on 16 cores)

The CPU side alone, `cpu_roundtrip_*` below (2-core CI box, 1 worker, submit()+wait() median, noisy
shared machine): empty job 6.2-9.4 -> 2.3-3.7 us; one route of a tiny expert: unchanged within noise
(~20-28 us, the read). On the H200 (15 workers) expect the empty job at ~3-6 us (1 barrier, not 3).
If c_sync eager still shows > 80 us, look at `fast_path` in the JSON (false = the driver path failed to
link and the torch path ran; the log says why).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.cpu_executor import CpuExecutor, default_num_threads
from services.engine.moe.reference import ClampedSwiGLU
from services.profiler.handoff_cost import measure_c_sync
from services.engine.moe.gguf_quant import dense_experts as gguf_dense_experts
from services.engine.moe.gguf_quant import format_types
from services.profiler.random_banks import fill_gguf_, fill_mxfp4_


def activation_dtype(banks: ExpertBanks, fp8_activations: str = "bfloat16") -> torch.dtype:
    """The hidden states' dtype for these banks: theirs, or for FP8 experts ``fp8_activations`` (bf16:
    a bf16 model, the dpbf16 kernel; float32: an fp32 model, the exact fp32-input kernel)."""
    dtype = banks.layers[0].tensors["down"].dtype
    if dtype == torch.uint8:  # mxfp4 (gpt-oss) or GGUF: a bf16 model
        return torch.bfloat16
    return getattr(torch, fp8_activations) if dtype == torch.float8_e4m3fn else dtype


def kernel_name(ex: CpuExecutor, banks: ExpertBanks, fmt: str, dtype: torch.dtype) -> str:
    """Which of a format's two kernels runs: FP8's dpbf16 or fp32-input one, a GGUF format's int8- or
    fp32-input one; "" for formats with one kernel."""
    if fmt == "fp8":
        return "dpbf16" if dtype == torch.bfloat16 and ex.fp8_bf16_inputs else "fp32-input"
    if format_types(fmt) is not None:
        return "int8-input" if ex.input_rounding(banks.layers[0].format, dtype) else "fp32-input"
    return ""


def make_banks(dtype: str, layers: int, E: int, D: int, I: int) -> ExpertBanks:
    """Random banks: bf16/fp32 uniform(-0.05, 0.05), fp8_block with random e4m3 codes (no NaN) and scales, or
    mxfp4 random bytes (every e2m1 code) with E8M0 scales in MX_SCALES and gpt-oss's zero biases / clamped
    SwiGLU (bf16 model), tiled from a pool (services/profiler/random_banks.py: why)."""
    if format_types(dtype) is not None:  # a GGUF format (banks.py's GGUF entries), valid blocks from a pool
        banks = ExpertBanks.allocate(ExpertFormat(dtype), layers, E, D, I, torch.bfloat16)
        for layer in banks.layers:
            fill_gguf_(layer.tensors, *format_types(dtype))
        return banks
    if dtype == "mxfp4":
        banks = ExpertBanks.allocate(ExpertFormat.MXFP4, layers, E, D, I, torch.bfloat16, bias=True,
                                     activation=ClampedSwiGLU())
        fill_mxfp4_(*(layer.tensors for layer in banks.layers))
        return banks
    if dtype != "fp8":
        banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, layers, E, D, I, getattr(torch, dtype))
        for layer in banks.layers:
            for t in layer.tensors.values():
                t.uniform_(-0.05, 0.05)
        return banks
    banks = ExpertBanks.allocate(ExpertFormat.FP8_BLOCK, layers, E, D, I, torch.bfloat16)
    for layer in banks.layers:
        for name, t in layer.tensors.items():
            if t.dtype == torch.float8_e4m3fn:
                codes = t.view(torch.uint8)
                codes.random_(0, 256)
                codes[(codes & 0x7F) == 0x7F] = 0x7E
            else:
                t.fill_(1e-3)
    return banks


CHECK_TOLERANCE = 2e-2  # max |executor - reference| / max |reference|: bf16 rounding of the SwiGLU output (~2^-9)


def check_output(ex: CpuExecutor, banks: ExpertBanks, A: int, dtype: torch.dtype) -> float:
    """One token routed to A experts of layer 0 against the torch reference on the dequantized experts
    (only those A: a whole bank would take longer than the benchmark). Returns the max error relative
    to the output's largest value; RuntimeError above CHECK_TOLERANCE (timing wrong code means nothing)."""
    from services.engine.moe.dequant import dense_experts
    from services.engine.moe.reference import moe_reference

    layer = banks.layers[0]
    E, D = layer.num_experts, layer.tensors["down"].shape[1]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, D, generator=g).to(dtype)  # [1, D]
    chosen = torch.randperm(E, generator=g)[:A]  # [A]
    weights = torch.rand(1, A, generator=g)  # [1, A]
    out = ex.forward(0, hidden, chosen[None], weights)  # [1, D] fp32
    picked = [layer.tensors[s][chosen] if s in layer.tensors else None
              for s in ("gate_up", "down", "gate_up_scale", "down_scale")]
    gguf = format_types(layer.format)
    gate_up, down = (gguf_dense_experts(*picked[:2], *gguf, torch.float32) if gguf is not None
                     else dense_experts(layer.format, *picked, torch.float32))  # [A, 2I, D], [A, D, I]
    bias = None if layer.bias is None else tuple(b[chosen].float() for b in layer.bias)
    ref = moe_reference(hidden.float(), torch.arange(A)[None], weights, gate_up, down, banks.activation, bias,
                        ex.input_rounding(layer.format, dtype))
    err = ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    if not err <= CHECK_TOLERANCE:
        raise RuntimeError(f"cpu executor output differs from the reference: max relative error {err:.3g} "
                           f"(tolerance {CHECK_TOLERANCE})")
    return err


def gemv_trial(ex: CpuExecutor, banks: ExpertBanks, A: int, seconds: float, step0: int, tokens: int,
               dtype: torch.dtype) -> tuple[float, int]:
    """Bytes/s of bs=`tokens` decode steps for `seconds` (hidden states in ``dtype``), experts rotating
    over layers and ids."""
    E = banks.layers[0].num_experts
    D = banks.layers[0].tensors["down"].shape[1]
    hidden = torch.randn(tokens, D).to(dtype)  # [T, D]
    weights = torch.rand(tokens, A)  # [T, A]
    base = torch.arange(A) * (E // A)  # A distinct experts spread over the bank
    nbytes, n, t0 = 0, step0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        layer = n % len(banks.layers)
        ids = ((base + n * 7) % E).repeat(tokens, 1)  # [T, A]: every token routes the same A experts
        ex.forward(layer, hidden, ids, weights)
        nbytes += ex.last_experts * banks.expert_nbytes()
        n += 1
    return nbytes / (time.perf_counter() - t0), n


def cpu_roundtrip(ex: CpuExecutor, banks: ExpertBanks, A: int, routes: int, dtype: torch.dtype, n: int = 2000) -> float:
    """Median seconds of submit() + wait() on the host (no GPU) for one token with ``routes`` of its A
    routes valid (the rest -1): the CPU side of the handoff's fixed cost."""
    D = banks.layers[0].tensors["down"].shape[1]
    x = torch.randn(1, D).to(dtype)  # [1, D]
    ids = torch.full((1, A), -1, dtype=torch.int64)  # [1, A]
    ids[0, :routes] = torch.arange(routes)
    w, out = torch.rand(1, A), torch.empty(1, D)
    times = []
    for i in range(n + 100):
        t0 = time.perf_counter()
        ex.submit(x, ids, w, 0, out=out)
        ex.wait()
        if i >= 100:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


DTYPES = ("bfloat16", "float32", "fp8", "mxfp4")


def bank_dtype(text: str) -> str:
    """--dtype: one of DTYPES or a GGUF format (q4_K, q4_K+q6_K, ...: gguf_quant.format_types)."""
    if text in DTYPES or format_types(text) is not None:
        return text
    raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)} or a GGUF format (a type of q4_K, q5_K, "
                                     f"q6_K, q8_0, mxfp4_gguf, or gate_up+down such as q4_K+q6_K), got {text!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128, help="experts per layer E (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token A (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=2048, help="hidden size D (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=768, help="expert intermediate size I (default: %(default)s)")
    p.add_argument("--dtype", type=bank_dtype, default="bfloat16",
                   help="bank dtype; fp8 = the fp8_block format with bf16 activations, mxfp4 = gpt-oss's experts "
                        "(biases, clamped SwiGLU, bf16 activations), or a GGUF format: q4_K, q5_K, q6_K, q8_0, "
                        "mxfp4_gguf, or gate_up+down such as q4_K+q6_K (default: %(default)s)")
    p.add_argument("--fp8-activations", choices=["bfloat16", "float32"], default="bfloat16",
                   help="with --dtype fp8: the hidden states' dtype, bfloat16 (a bf16 model: the dpbf16 kernel) or "
                        "float32 (an fp32 model: the exact fp32-input kernel) (default: %(default)s)")
    p.add_argument("--layers", type=int, default=1, help="banks rotated through (more layers: colder caches)")
    p.add_argument("--tokens", type=int, default=1, help="tokens per step (bs)")
    p.add_argument("--threads", type=int, default=None,
                   help="executor workers (default: as the hybrid backend on CUDA, one per physical core but one)")
    p.add_argument("--isa", default="", help="force avx512bf16|avx512|avx2|scalar")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds; best and median are reported (default: %(default)s)")
    p.add_argument("--trial-seconds", type=float, default=0.5, help="seconds per timed round (default: %(default)s)")
    p.add_argument("--read-mib", type=int, default=1024, help="read-ceiling buffer size")
    p.add_argument("--json", default=None, help="write the results to this path")
    args = p.parse_args(argv)

    t_setup = time.perf_counter()
    banks = make_banks(args.dtype, args.layers, args.experts, args.hidden, args.intermediate)
    setup_s = time.perf_counter() - t_setup
    dtype = activation_dtype(banks, args.fp8_activations)
    ex = CpuExecutor(banks, num_threads=args.threads or default_num_threads(leave_driver_core=True), isa=args.isa)
    read_buf = torch.ones(args.read_mib * (1 << 20) // 4, dtype=torch.float32)
    check_err = check_output(ex, banks, args.top_k, dtype)
    gemv_trial(ex, banks, args.top_k, 0.2, 0, args.tokens, dtype)  # warm-up: threads, page tables

    reads, gemvs, step = [], [], 0
    for _ in range(args.rounds):
        reads.append(read_buf.numel() * 4 / ex._impl.read_seconds(read_buf, 3))
        bw, step = gemv_trial(ex, banks, args.top_k, args.trial_seconds, step, args.tokens, dtype)
        gemvs.append(bw)
    t0 = time.perf_counter()
    for _ in range(3):
        read_buf.sum()
    torch_sum = 3 * read_buf.numel() * 4 / (time.perf_counter() - t0)

    expert_mb = banks.expert_nbytes() / 1e6
    res = {
        "isa": ex.isa, "threads": ex.num_threads, "dtype": args.dtype, "activations": str(dtype).removeprefix("torch."),
        "kernel": kernel_name(ex, banks, args.dtype, dtype),
        "tokens": args.tokens,
        "experts": args.experts, "top_k": args.top_k, "hidden": args.hidden, "intermediate": args.intermediate,
        "expert_mb": expert_mb, "check_max_rel_err": check_err, "banks_setup_s": setup_s,
        "read_ceiling_gbs": max(reads) / 1e9, "read_median_gbs": statistics.median(reads) / 1e9,
        "torch_sum_gbs": torch_sum / 1e9,
        "executor_gbs": max(gemvs) / 1e9, "executor_median_gbs": statistics.median(gemvs) / 1e9,
        "ms_per_layer_step": args.top_k * banks.expert_nbytes() / max(gemvs) * 1e3,
    }
    res["executor_vs_ceiling"] = res["executor_gbs"] / res["read_ceiling_gbs"]
    res["cpu_roundtrip_empty_s"] = cpu_roundtrip(ex, banks, args.top_k, 0, dtype)
    res["cpu_roundtrip_1route_s"] = cpu_roundtrip(ex, banks, args.top_k, 1, dtype, n=300)
    if torch.cuda.is_available():
        res.update(measure_c_sync(ex, args.hidden, args.top_k, dtype))
        res["device"] = torch.cuda.get_device_name()

    kernel = f" ({res['kernel']} kernel, {res['activations']} activations)" if res['kernel'] else ""
    print(f"CPU MoE executor · isa {res['isa']} · {res['threads']} threads · {args.dtype}{kernel} · bs={args.tokens} · "
          f"top-{args.top_k} of {args.experts} · expert {args.hidden}x{args.intermediate} ({expert_mb:.1f} MB)")
    print(f"banks built in {setup_s:.1f} s ({banks.total_nbytes() / 1e9:.2f} GB) · output vs torch reference "
          f"(one token, layer 0): max relative error {check_err:.2e}")
    print(f"{'measure':<36}{'best GB/s':>12}{'median GB/s':>14}")
    print(f"{'CPU read ceiling (pool, AVX sum)':<36}{res['read_ceiling_gbs']:>12.1f}{res['read_median_gbs']:>14.1f}")
    print(f"{'torch sum (reference)':<36}{res['torch_sum_gbs']:>12.1f}{'':>14}")
    print(f"{'executor GEMV (bytes read / time)':<36}{res['executor_gbs']:>12.1f}{res['executor_median_gbs']:>14.1f}")
    print(f"executor / ceiling = {res['executor_vs_ceiling']:.0%} (target >= 80%) · {res['ms_per_layer_step']:.2f} ms per layer-step")
    print(f"host submit()+wait(), CPU side only: empty job {res['cpu_roundtrip_empty_s'] * 1e6:.1f} us · "
          f"1 route {res['cpu_roundtrip_1route_s'] * 1e6:.1f} us (one expert read)")
    if "c_sync_s" in res:
        print(f"c_sync eager (submit + sync + add per layer, CUDA, {'driver fast path' if res['fast_path'] else 'TORCH PATH: fast path failed'})"
              f" = {res['c_sync_s'] * 1e6:.1f} us "
              f"(layer {res['layer_with_handoff_s'] * 1e6:.1f} us with, {res['layer_gpu_only_s'] * 1e6:.1f} us without)")
        print(f"c_sync eager, torch copies (the old path) = {res['c_sync_torch_s'] * 1e6:.1f} us")
        print(f"c_sync graph mode (captured layer loop) = {res['c_sync_graph_s'] * 1e6:.1f} us "
              f"(layer {res['graph_layer_with_handoff_s'] * 1e6:.1f} us with, {res['graph_layer_gpu_only_s'] * 1e6:.1f} us without)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

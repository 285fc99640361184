"""bs=1 decode speed of the `resident` backend against the HBM bandwidth bound (issue 2, part 7).

    python -m benchmarks.bench_resident_decode [--model synthetic:qwen3-30b-a3b] [--tokens 128] [--json PATH]
        [--batch N] [--profile-steps K] [--prefill-prompts P]

Loads the model on CUDA in bf16 with every expert resident, measures the device's HBM bandwidth in
the same run (large device-to-device copy: bytes read + written / time), then decodes ``--tokens``
tokens at batch size 1, eager and (unless --no-graph) as a captured CUDA graph of one decode step,
with each decode expert path (Triton GEMV reading experts in place; torch gather + bmm).
The bound is ``active weight bytes per token / HBM bandwidth`` (attention, norms, routers, A experts
per MoE layer, LM head); the ratio says how close decode gets to streaming exactly those bytes.

``--batch N`` (N > 1) decodes N sequences at once through the server's own path instead (runner.DecodeGraphs:
a graph captured for N rows, inputs copied up from pinned memory each step, the argmax fed back on the
device): ms per step, tok/s, the distinct experts the N rows route to per layer (one eager step, hooked) and
what those expert bytes per step imply in GB/s. ``--profile-steps K`` then profiles K more such steps
(batch_step.py, gpu_profile.py): GPU time by kernel family with its share of the step, and GPU busy vs wall.
``--prefill-prompts P`` times (and with K profiles) one eager prefill of P packed prompts of --prompt-len
tokens, and one mixed step as the runner runs it (``_forward_mixed``: 1 prompt eager + the N decode rows
by replay).

Kernels per decode step (``python -m benchmarks.count_decode_ops``: aten ops + Triton launches of one
bs=1 decode step, counted on the CPU with the GPU's code path; ~ CUDA kernels):

    before: 65 per layer (2x RMSNorm 8 ops + residual add, 3 q/k/v matmuls, q/k norms 16, ropes 10,
            KV write/gather/mask/SDPA 7, router 1+5, experts 2 Triton + sum + cast, o_proj)
            -> 48 x 65 + 18 = 3138 per token for Qwen3-30B-A3B
    after:  11 per layer: add+RMSNorm x2 (Triton), fused qkv matmul, q/k norm + rope (Triton, in place),
            KV write + attention over the slot's cache (Triton, no gather/mask), o_proj, router matmul,
            softmax/top-k/renorm (Triton), expert GEMV gate_up + down + combine (Triton)
            -> 48 x 11 + 11 = 539 per token

Measured before (H200, graph replay, Triton GEMV): 98 tok/s = 10.2 ms/token, i.e. ~2.5 us per kernel
beyond the ~1.5-2 ms of weight bytes. Predicted after: 539 kernels x ~2 us of per-kernel cost + ~2 ms
of bytes (the experts' GEMV at ~80% of HBM) = ~3 ms/token -> ~300-400 tok/s in a graph (bound 706);
eager ~3x faster than the 11 tok/s before (~25 launches per layer instead of ~100, allocations included).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.batch_step import batch_report, gpu_ms, print_batch_report
from services.engine.config import EngineConfig, MoEBackend
from services.engine.models.registry import load_model
from services.engine.moe.resident import DecodeKernel
from services.engine.runtime.kv_cache import ForwardBatch, KVCache


def hbm_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting read + write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    seconds = gpu_ms(lambda: dst.copy_(src), iters) / 1e3  # per copy
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / seconds


def _prefill(lm, kv: KVCache, prompt: list[int]) -> int:
    ids = torch.tensor(prompt, device="cuda")
    logits = lm.model(ids, torch.arange(len(prompt), device="cuda"), ForwardBatch.single(0, 0, len(prompt)), kv)
    return int(logits[0].argmax())


def decode_eager(lm, kv: KVCache, prompt: list[int], tokens: int, warmup: int) -> float:
    """Seconds per token of eager decode (one forward + argmax per token, host reads the token)."""
    token, pos = _prefill(lm, kv, prompt), len(prompt)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for step in range(warmup + tokens):
        if step == warmup:
            torch.cuda.synchronize()
            start.record()
        batch = ForwardBatch.single(0, pos, 1)
        logits = lm.model(torch.tensor([token], device="cuda"), torch.tensor([pos], device="cuda"), batch, kv)
        token, pos = int(logits[0].argmax()), pos + 1
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / tokens


def decode_graph(lm, kv: KVCache, prompt: list[int], tokens: int, warmup: int) -> float:
    """Seconds per token with one decode step captured as a CUDA graph (static KV window = the whole
    cache; the graph feeds its argmax back as the next input and advances the position itself)."""
    token = _prefill(lm, kv, prompt)
    ids = torch.tensor([token], device="cuda")  # [1] static input
    pos = torch.tensor([len(prompt)], device="cuda")  # [1] static position
    batch = ForwardBatch(slots=[0], start_pos=[len(prompt)], query_lens=[1], kv_len=kv.max_seq_len,
                         slot_ids=torch.zeros(1, dtype=torch.long, device="cuda"))

    def step() -> None:
        logits = lm.model(ids, pos, batch, kv)
        ids.copy_(logits.argmax(dim=-1))
        pos.add_(1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up on a side stream before capture (allocator, lazy inits)
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        graph.replay()
    start.record()
    for _ in range(tokens):
        graph.replay()
    end.record()
    end.synchronize()
    if int(pos.item()) >= kv.max_seq_len:
        raise RuntimeError("decode ran past the KV cache; raise --max-seq-len")
    return start.elapsed_time(end) / 1e3 / tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_resident_decode", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b", help="model to load resident on cuda (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=128, help="timed decode tokens")
    p.add_argument("--warmup", type=int, default=8, help="untimed decode tokens first (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens prefilled before decoding (default: %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=512, help="KV window (the graph attends over all of it)")
    p.add_argument("--no-graph", action="store_true", help="eager only")
    p.add_argument("--moe-expert-dtype", default="checkpoint", choices=["checkpoint", "fp8"],
                   help="experts as stored, or quantized to FP8 blocks at load (default: %(default)s)")
    p.add_argument("--decode-kernels", default="triton,torch",
                   help="decode expert paths to measure: triton (GEMV in place), torch (gather + bmm)")
    p.add_argument("--batch", type=int, default=1,
                   help="N > 1: decode N sequences per step through the server's CUDA-graph path "
                        "(default: %(default)s)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed tokens, profile K more batch-N steps: GPU time by kernel family "
                        "(default: %(default)s, off)")
    p.add_argument("--prefill-prompts", type=int, default=0,
                   help="also time one eager prefill of P packed prompts of --prompt-len tokens, and a mixed step "
                        "(default: %(default)s, off)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_resident_decode: needs CUDA", file=sys.stderr)
        return 2
    if args.batch < 1 or args.profile_steps < 0 or args.prefill_prompts < 0:
        p.error("--batch must be >= 1, --profile-steps and --prefill-prompts >= 0")
    need = args.prompt_len + 2 * (args.warmup + args.tokens) + args.profile_steps + 8
    if need > args.max_seq_len:
        print(f"--max-seq-len {args.max_seq_len} < {need} positions this run needs", file=sys.stderr)
        return 2

    bw = hbm_bandwidth()
    t0 = time.perf_counter()
    cfg = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", moe_backend=MoEBackend.RESIDENT,
                       max_seq_len=args.max_seq_len, moe_expert_dtype=args.moe_expert_dtype)
    lm = load_model(cfg)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    spec = lm.spec
    # the A routed experts of each MoE layer in the banks' own format (FP8: half of bf16's bytes)
    active = spec.active_weight_nbytes(torch.bfloat16) - spec.num_moe_layers * spec.top_k * (
        spec.expert_nbytes(torch.bfloat16) - lm.banks.expert_nbytes())
    bound = bw / active
    prompt = torch.randint(0, spec.vocab_size, (args.prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()

    results = {"model": args.model, "expert_format": lm.banks.layers[0].format.value,
               "device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S"), "build_seconds": round(build_s, 2),
               "hbm_bytes_per_second": bw, "active_weight_bytes_per_token": active,
               "bound_tokens_per_second": bound, "tokens": args.tokens, "modes": {}}
    modes = [("eager", decode_eager)] + ([] if args.no_graph else [("graph", decode_graph)])
    if args.batch > 1 or args.profile_steps or args.prefill_prompts:  # the server's path at batch N
        modes = []
        lm.backend.decode = DecodeKernel("triton")
        results["batch"] = batch_report(lm, args)
    for kernel in args.decode_kernels.split(",") if modes else []:
        lm.backend.decode = DecodeKernel(kernel)
        for mode, fn in modes:
            name = f"{mode}/{kernel}"
            kv = KVCache(spec, 1, args.max_seq_len, "cuda", torch.bfloat16)
            try:
                s = fn(lm, kv, prompt, args.tokens, args.warmup)
                results["modes"][name] = {"tokens_per_second": 1 / s, "ms_per_token": s * 1e3,
                                          "ratio_to_bound": (1 / s) / bound, "kernel_used": lm.backend.decode.kind}
            except Exception as e:  # report a failed capture instead of losing the other numbers
                results["modes"][name] = {"error": f"{type(e).__name__}: {e}"}
            del kv

    print(f"model {args.model} on {results['device']} (bf16, resident), built in {build_s:.1f} s")
    print(f"HBM bandwidth (D2D copy, read+write): {bw / 1e9:.0f} GB/s; active weights/token: {active / 1e9:.2f} GB;"
          f" bound: {bound:.1f} tok/s")
    if results["modes"]:
        print(f"{'mode/decode kernel':<20}{'tok/s':>10}{'ms/token':>10}{'ratio':>8}  kernel used")
    for name, r in results["modes"].items():
        if "error" in r:
            print(f"{name:<20}  failed: {r['error']}")
        else:
            print(f"{name:<20}{r['tokens_per_second']:>10.1f}{r['ms_per_token']:>10.2f}{r['ratio_to_bound']:>8.2f}"
                  f"  {r['kernel_used']}")
    if "batch" in results:
        print_batch_report(results["batch"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench_resident_decode --batch / --profile-steps / --prefill-prompts: a decode step of N sequences through the
server's own CUDA-graph path (runner.DecodeGraphs), timed and profiled by kernel family, with the experts it
routes to; and one eager packed prefill and one mixed step (1 prompt eager + the N decode rows by replay, as
runner._forward_mixed), timed and profiled the same way.

Slots: 0..N-1 the decode rows, N..N+P-1 the prefill prompts, N+P the mixed step's prompt, N+P+1 the graphs'
padding slot. The graph for N rows is captured before anything is prefilled (its eager check writes
position 0 of slots 0..N-1).
"""

from __future__ import annotations

import torch

from benchmarks.gpu_profile import format_families, format_kernels, kernel_families, kernel_profile
from services.engine.runtime.kv_cache import ForwardBatch, KVCache
from services.engine.runtime.runner import DecodeGraphs


def gpu_ms(fn, repeats: int = 1) -> float:
    """Milliseconds of device time per call of ``fn`` (CUDA events around ``repeats`` calls)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def distinct_experts(backend, step) -> list[int]:
    """Run ``step`` once with ``backend.forward`` wrapped: per MoE layer, the distinct experts its rows route to."""
    seen: dict[int, list[torch.Tensor]] = {}
    forward = backend.forward

    def recording(moe_layer, hidden, topk_ids, topk_weights, *args, **kwargs):
        seen.setdefault(moe_layer, []).append(topk_ids.reshape(-1))
        return forward(moe_layer, hidden, topk_ids, topk_weights, *args, **kwargs)

    backend.forward = recording  # an instance attribute: MoE layers call self.backend.forward(...)
    try:
        step()
    finally:
        del backend.forward
    out = []
    for layer in sorted(seen):
        ids = torch.cat(seen[layer])
        out.append(int(torch.unique(ids[ids >= 0]).numel()))
    return out


def profiled(step, steps: int, wall_ms: float) -> dict:
    """Kernels (all) and the family table of ``steps`` calls of ``step`` whose wall time is ``wall_ms``."""
    if not steps:
        return {}
    try:
        rows = kernel_profile(step, steps, top=None)
    except Exception as exc:  # noqa: BLE001 - a profiler failure must not lose the timed numbers
        return {"profile_error": f"{type(exc).__name__}: {exc}"}
    return {"families": kernel_families(rows, wall_ms * 1e3), "kernels": rows[:25]}


@torch.inference_mode()
def batch_report(lm, args) -> dict:
    N, L, P, K = args.batch, args.prompt_len, args.prefill_prompts, args.profile_steps
    spec, dev = lm.spec, lm.device
    kv = KVCache(spec, N + P + 2, args.max_seq_len, dev, lm.dtype)
    graphs = DecodeGraphs(lm.model, kv, max_batch=N, pad_slot=N + P + 1, sizes=[N])  # the server: all of 1..N
    graphs.capture()
    if N not in graphs.graphs:
        return {"error": f"no CUDA graph captured for batch {N} (see the log)"}
    gen = torch.Generator().manual_seed(1)

    def prompts(n: int) -> torch.Tensor:  # [n * L] distinct random prompts
        return torch.randint(3, spec.vocab_size, (n * L,), generator=gen).to(dev)

    def prefill(slots: list[int]) -> torch.Tensor:  # one packed eager forward -> logits [n, V]
        n = len(slots)
        return lm.model(prompts(n), torch.arange(L, device=dev).repeat(n),
                        ForwardBatch(slots=slots, start_pos=[0] * n, query_lens=[L] * n), kv)

    rows = list(range(N))
    state = {"ids": prefill(rows).argmax(-1), "pos": L}

    def decode_step() -> None:  # as ModelRunner.launch for a chained decode batch (ids still on the device)
        out = graphs.run([0] * N, [state["pos"]] * N, rows, state["ids"])
        state["ids"], state["pos"] = out.argmax(-1), state["pos"] + 1

    for _ in range(args.warmup):
        decode_step()
    ms = gpu_ms(decode_step, args.tokens)
    experts = distinct_experts(lm.backend, lambda: lm.model(
        state["ids"], torch.full((N,), state["pos"], device=dev),
        ForwardBatch(slots=rows, start_pos=[state["pos"]] * N, query_lens=[1] * N), kv))
    expert_bytes = sum(experts) * lm.banks.expert_nbytes()
    report = {"batch": N, "ms_per_step": ms, "tokens_per_second": N / ms * 1e3,
              "distinct_experts_per_layer": experts,
              "distinct_experts_mean": sum(experts) / max(1, len(experts)),
              "expert_bytes_per_step": expert_bytes, "expert_gbs_at_step_time": expert_bytes / ms / 1e6,
              "decode": profiled(decode_step, K, ms)}
    fams = report["decode"].get("families")
    if fams:  # the expert kernels' own rate: their bytes over their GPU time
        us = next((f["us_per_step"] for f in fams["families"] if f["family"] == "expert GEMM/GEMV"), 0)
        report["expert_gbs_in_expert_kernels"] = expert_bytes / us / 1e3 if us else None
    if P:
        slots = list(range(N, N + P))
        prefill(slots)  # warm this shape (cuBLAS heuristics, packed-attention masks)
        pms = gpu_ms(lambda: prefill(slots), 3)
        report["prefill"] = {"prompts": P, "prompt_len": L, "ms": pms, "prompt_tokens_per_second": P * L / pms * 1e3,
                             **profiled(lambda: prefill(slots), 1 if K else 0, pms)}

        def mixed() -> None:  # runner._forward_mixed: the prompt eager, the decode rows by replay
            prefill([N + P])
            decode_step()

        mixed()
        mms = gpu_ms(mixed, 3)
        report["mixed"] = {"decode_rows": N, "prompt_len": L, "ms": mms, "extra_ms_over_decode": mms - ms,
                           **profiled(mixed, 1 if K else 0, mms)}
    if state["pos"] >= kv.max_seq_len:
        raise RuntimeError("decode ran past the KV cache; raise --max-seq-len")
    return report


def print_batch_report(r: dict) -> None:
    if "error" in r:
        print(f"batch decode failed: {r['error']}")
        return
    print(f"\nbatch {r['batch']} (server graph path): {r['ms_per_step']:.2f} ms/step = "
          f"{r['tokens_per_second']:.0f} tok/s;"
          f" distinct experts/layer {r['distinct_experts_mean']:.1f} -> {r['expert_bytes_per_step'] / 1e9:.2f} GB/step"
          f" = {r['expert_gbs_at_step_time']:.0f} GB/s at the step time"
          + (f", {r['expert_gbs_in_expert_kernels']:.0f} GB/s within the expert kernels"
             if r.get("expert_gbs_in_expert_kernels") else ""))
    for name, title in (("decode", f"decode step, batch {r['batch']}"), ("prefill", "eager packed prefill"),
                        ("mixed", "mixed step (1 prompt eager + decode rows by replay)")):
        part = r.get(name) if name != "decode" else r["decode"]
        if not part:
            continue
        if name != "decode":
            print(f"\n{title}: {part['ms']:.2f} ms" + (f" ({part['extra_ms_over_decode']:+.2f} ms over a decode step)"
                                                        if name == "mixed" else ""))
        if part.get("profile_error"):
            print(f"{title}: profile failed: {part['profile_error']}")
        elif part.get("families"):
            print("\n" + format_families(f"{title}: GPU time by kernel family", part["families"]))
            print(format_kernels(part["kernels"][:12]))

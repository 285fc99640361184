"""Where the host time of one eager prefill forward goes (resident, the model's own device).

    python -m benchmarks.prefill_host_time [--model synthetic:qwen3-30b-a3b?layers=24] [--prompt-len 64]
        [--prompts 1] [--device cuda] [--json PATH]

Why: on the H200 one eager prefill of a 64-token prompt took 41 ms while the GPU was busy 7.9 ms of it, i.e.
~1.4 ms of host time per layer for ~15 launches. Two causes look the same from the GPU's side: a host sync in
each layer (the host waits, then the GPU waits for the next layer's launches) or slow launches. This tells
them apart and prices the parts:

- ``enqueue_ms`` (host time to issue the forward, no sync) against ``wall_ms`` (issued and finished) and
  ``gpu_ms`` (CUDA events): without syncs the host returns with the GPU still busy behind it;
- ``syncs``: the CUDA syncs torch reports in one forward (``torch.cuda.set_sync_debug_mode``: stream syncs
  and pageable copies; benchmarks/count_decode_ops.py counts the Python-level ones on the CPU);
- ``layer_host_us``: host time per decoder layer (module hooks, no sync), and per launch kind (one call of
  each op the layer runs, on the layer's shapes, issued ``LAUNCH_REPEATS`` times without a sync);
- ``profile``: the functions with the most host time (cProfile, own time) over 3 forwards.

On the CPU it runs the same (torch path, no sync report) so a test can smoke it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from benchmarks.batch_step import gpu_ms
from services.engine.config import EngineConfig, MoEBackend
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch, KVCache


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_us(fn, device: torch.device, repeats: int) -> float:
    """Host microseconds per call of ``fn``, issued ``repeats`` times without a sync (after one warm call)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    us = (time.perf_counter() - t0) / repeats * 1e6
    _sync(device)
    return us


def _launch_costs(lm, device: torch.device, T: int, repeats: int) -> dict[str, float]:
    """Host us of one call of each op kind a layer issues, on layer 0's shapes."""
    from services.engine.models import fused

    layer = lm.model.model.layers[0]
    D = lm.spec.hidden_size
    x = torch.randn(T, D, device=device, dtype=lm.dtype)
    attn = layer.self_attn
    costs = {
        "torch add (1 elementwise launch)": lambda: x + x,
        "F.linear qkv (cuBLAS)": lambda: F.linear(x, attn.qkv.weight),
        "rms_norm + residual (fused.call)": lambda: layer.post_attention_layernorm(x, x),
    }
    ffn = layer.ffn
    if hasattr(ffn, "router_linear"):
        logits = F.linear(x, ffn.router_linear.weight)
        from services.engine.moe.layer import route

        costs["router top-k (fused.call)"] = lambda: route(logits, ffn.top_k, ffn.renormalize)
        w, ids = route(logits, ffn.top_k, ffn.renormalize)
        costs["experts: backend.forward (align 2 + GEMM 2 + combine 1 launches)"] = (
            lambda: ffn.backend.forward(ffn.moe_layer, x, ids, w))
    costs["Python only: fused.enabled x 10"] = lambda: [fused.enabled(x, "rmsnorm") for _ in range(10)]
    return {name: round(_host_us(fn, device, repeats), 1) for name, fn in costs.items()}


def _count_syncs(fn, device: torch.device) -> tuple[int, list[str]]:
    """CUDA syncs torch reports during ``fn()`` (0 off CUDA), with the first few messages."""
    if device.type != "cuda":
        fn()
        return 0, []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    return len(msgs), msgs[:5]


LAUNCH_REPEATS = 50  # calls per op kind in launch_host_us


def measure(model: str, device: str, prompt_len: int, prompts: int, repeats: int = LAUNCH_REPEATS) -> dict:
    dev = torch.device(device)
    cfg = EngineConfig(model=model, device=device, dtype="bfloat16" if dev.type == "cuda" else "float32",
                       moe_backend=MoEBackend.RESIDENT, max_seq_len=prompt_len + 8)
    lm = load_model(cfg)
    kv = KVCache(lm.spec, prompts, prompt_len + 8, dev, lm.dtype)
    ids = torch.randint(3, lm.spec.vocab_size, (prompts * prompt_len,)).to(dev)
    pos = torch.arange(prompt_len, device=dev).repeat(prompts)

    def forward() -> torch.Tensor:  # a fresh batch each time, as a served step
        batch = ForwardBatch(slots=list(range(prompts)), start_pos=[0] * prompts, query_lens=[prompt_len] * prompts)
        return lm.model(ids, pos, batch, kv)

    for _ in range(2):
        forward()  # compiles, cuBLAS heuristics
    _sync(dev)
    enqueue, wall = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        forward()
        t1 = time.perf_counter()
        _sync(dev)
        enqueue.append((t1 - t0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    gpu = gpu_ms(forward) if dev.type == "cuda" else None

    layer_us: list[float] = []
    marks: dict[int, float] = {}
    handles = []
    for i, layer in enumerate(lm.model.model.layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: marks.__setitem__(i, time.perf_counter())))
        handles.append(layer.register_forward_hook(
            lambda m, a, o, i=i: layer_us.append((time.perf_counter() - marks[i]) * 1e6)))
    _sync(dev)
    forward()
    _sync(dev)
    for h in handles:
        h.remove()

    syncs, sync_msgs = _count_syncs(forward, dev)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        forward()
    prof.disable()
    _sync(dev)
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "model": model, "device": str(dev), "prompt_len": prompt_len, "prompts": prompts,
        "layers": lm.spec.num_layers, "enqueue_ms": round(mean(enqueue), 2), "wall_ms": round(mean(wall), 2),
        "gpu_ms": None if gpu is None else round(gpu, 2), "syncs": syncs, "sync_messages": sync_msgs,
        "layer_host_us": {"mean": round(mean(layer_us), 1), "first": round(layer_us[0], 1),
                          "max": round(max(layer_us), 1)},
        "launch_host_us": _launch_costs(lm, dev, prompts * prompt_len, repeats),
        "profile": text.getvalue(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prefill_host_time", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:qwen3-30b-a3b?layers=24",
                   help="checkpoint dir or 'synthetic:NAME[?layers=N]', loaded resident (default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (bf16) or cpu (fp32, a smoke run) (default: cuda when present, else cpu)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (default: %(default)s)")
    p.add_argument("--prompts", type=int, default=1,
                   help="prompts packed into the one prefill forward (default: %(default)s)")
    p.add_argument("--json", help="also write the results to this JSON file (default: none)")
    args = p.parse_args(argv)
    r = measure(args.model, args.device, args.prompt_len, args.prompts)
    print(f"{r['model']} on {r['device']}: {r['prompts']} x {r['prompt_len']}-token eager prefill, {r['layers']} layers")
    print(f"enqueue {r['enqueue_ms']} ms (host, no sync) · wall {r['wall_ms']} ms · gpu {r['gpu_ms']} ms · "
          f"{r['syncs']} CUDA syncs reported in one forward")
    for msg in r["sync_messages"]:
        print(f"  sync: {msg}")
    lu = r["layer_host_us"]
    print(f"host per decoder layer: mean {lu['mean']} us (first {lu['first']}, max {lu['max']})")
    for name, us in r["launch_host_us"].items():
        print(f"  {us:8.1f} us  {name}")
    print(r["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

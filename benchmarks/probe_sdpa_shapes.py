"""Diagnostic (CUDA): what does a prefill SDPA call cost the first time its shape is seen?

    python -m benchmarks.probe_sdpa_shapes [--heads 32] [--kv-heads 4] [--head-dim 128] [--lengths 37,52,61,88]

torch >= 2.10 with a bundled cuDNN >= 9.15 tries cuDNN attention first on sm90 / sm100, and cuDNN builds an
execution plan per new shape. Prompts of distinct lengths (and packed steps' (T, Tk)) are new shapes, so
with cuDNN each prefill could pay a plan build. For every length, in a fresh order for each row: the
first call and a repeated call of a causal GQA prefill (bf16, Qwen3-30B-A3B's heads by default) under
torch's default backend order, then under the engine's ``PREFILL_BACKENDS`` (no cuDNN), each as the
causal call of one prompt and as the biased call of packed prefill (attention.py). A first call that costs far more than the repeat
under the default order, and not under ours, is the plan build the engine now avoids (docs/serving.md).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from services.engine.models.attention import PREFILL_BACKENDS


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="probe_sdpa_shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--lengths", default="37,52,61,88,97", help="comma-separated prompt lengths, each a new shape")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_sdpa_shapes: needs CUDA", file=sys.stderr)
        return 1
    H, K, Dh = args.heads, args.kv_heads, args.head_dim
    lengths = [int(x) for x in args.lengths.split(",")]
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"SDPA priority {[str(b) for b in torch._C._get_sdp_priority_order()]}")
    print("length  order    call     first ms  repeat ms")
    for offset, (name, ctx) in enumerate([("default", contextlib.nullcontext), ("engine", lambda: sdpa_kernel(PREFILL_BACKENDS))]):
        for n in lengths:
            n += offset  # a shape neither order has seen
            q = torch.randn(1, H, n, Dh, device="cuda", dtype=torch.bfloat16)
            k, v = (torch.randn(1, K, n, Dh, device="cuda", dtype=torch.bfloat16) for _ in range(2))

            G = H // K
            qg = q.view(1, K, G, n, Dh).transpose(2, 3).reshape(1, K, n * G, Dh)  # packed: G rows per token
            causal = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
            bias = torch.zeros((), dtype=q.dtype, device="cuda").where(causal, float("-inf"))
            bias = bias.repeat_interleave(G, dim=0)  # [n G, n]

            def causal_call():
                with ctx():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def biased_call():
                with ctx():
                    F.scaled_dot_product_attention(qg, k, v, attn_mask=bias)
            for kind, call in (("causal", causal_call), ("biased", biased_call)):
                first, repeat = _ms(call), _ms(call)
                print(f"{n:6d}  {name:7s}  {kind:7s}  {first:8.2f}  {repeat:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

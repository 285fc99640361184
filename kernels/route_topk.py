"""route_topk: the MoE router's softmax -> top-k -> (renormalise) in ONE launch.

Dimension legend: T tokens · E experts · A experts per token.

Why: in torch this is 5 kernels per MoE layer (cast, softmax, topk, sum, div); a bs=1 decode step is
launch-bound. One program per token holds its E logits in registers, takes the softmax in fp32, picks
the A largest probabilities one by one (descending, like ``torch.topk``; the lowest index wins a tie)
and divides them by their sum when ``renormalize``.

The reference is ``services.engine.moe.layer.route`` (torch); tests/kernels/test_route_topk.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_topk_kernel(
    logits_ptr, w_ptr, ids_ptr,
    E, A, stride_l, stride_w, stride_ids,
    RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr,
):
    t = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    mask_e = offs_e < E
    x = tl.load(logits_ptr + t * stride_l + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)  # [BLOCK_E] softmax; padding lanes are 0
    work = tl.where(mask_e, p, -1.0)  # padding never picked (probabilities are >= 0)
    offs_a = tl.arange(0, BLOCK_A)
    vals = tl.zeros([BLOCK_A], dtype=tl.float32)
    ids = tl.zeros([BLOCK_A], dtype=tl.int64)
    for a in tl.static_range(BLOCK_A):
        if a < A:
            best = tl.max(work, axis=0)
            idx = tl.min(tl.where(work == best, offs_e, BLOCK_E), axis=0)  # lowest index among equals
            vals = tl.where(offs_a == a, best, vals)
            ids = tl.where(offs_a == a, idx.to(tl.int64), ids)
            work = tl.where(offs_e == idx, -1.0, work)
    if RENORMALIZE:
        vals = vals / tl.sum(vals, axis=0)  # lanes >= A hold 0
    mask_a = offs_a < A
    tl.store(w_ptr + t * stride_w + offs_a, vals, mask=mask_a)
    tl.store(ids_ptr + t * stride_ids + offs_a, ids, mask=mask_a)


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (any float dtype, contiguous last dim) -> (topk_weights [T, A] fp32,
    topk_ids [T, A] int64), one launch. Same contract as ``services.engine.moe.layer.route``."""
    T, E = router_logits.shape
    if router_logits.stride(1) != 1 or not 0 < top_k <= E:
        raise ValueError(f"route_topk: router_logits {tuple(router_logits.shape)} (stride {router_logits.stride()}) "
                         f"needs a contiguous last dim and 0 < top_k={top_k} <= E")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=router_logits.device)
    if T:
        _route_topk_kernel[(T,)](
            router_logits, weights, ids,
            E, top_k, router_logits.stride(0), weights.stride(0), ids.stride(0),
            RENORMALIZE=renormalize, BLOCK_E=triton.next_power_of_2(E), BLOCK_A=triton.next_power_of_2(top_k),
            num_warps=4 if E >= 128 else 1,
        )
    return weights, ids

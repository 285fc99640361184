"""prefetch_pick: which experts of the next layer to copy ahead, in ONE launch (services/engine/moe/prefetch.py).

Dimension legend: T tokens · E experts per layer · A experts per token (the router's top-k) · B experts
per token to prefetch (B <= A) · L MoE layers.

Per token: the predicted routing is the top-A of the predictor's logits; walking it from the most likely
expert down, the first B that are not cached (``slot_of_id[layer*E + e] < 0``) are picked. Fewer than B
uncached among the A leave -1 (skipped by ensure_experts). So B bounds the copies per token and layer,
spent on the likeliest misses: hits cost no bandwidth, and an unlikely expert is not worth a copy.

Why one kernel: in torch this is topk, a gather of the cache table, a compare, a cumsum, a scatter
(6-8 launches per layer), and bs=1 decode is launch-bound. The program of a token holds its E logits in
registers and picks the A largest one by one (the lowest index wins a tie, like kernels/route_topk.py).
"""

from __future__ import annotations

import torch


_KERNEL = None


def _pick_kernel():
    """The Triton kernel, defined on first use: CPU test runs set TRITON_INTERPRET at collection, after the
    engine (which imports this module for the reference) may have been imported."""
    global _KERNEL
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["base"])  # base = layer x E: one compile for every layer
    def _prefetch_pick_kernel(
        logits_ptr, slot_of_id_ptr, out_ptr,
        base, E, A, B, stride_l, stride_o,
        BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr,
    ):
        t = tl.program_id(0)
        offs_e = tl.arange(0, BLOCK_E)
        mask_e = offs_e < E
        work = tl.load(logits_ptr + t * stride_l + offs_e, mask=mask_e, other=float("-inf")).to(tl.float32)
        offs_b = tl.arange(0, BLOCK_B)
        picked = tl.full([BLOCK_B], -1, dtype=tl.int64)
        count = tl.sum(tl.zeros([BLOCK_B], dtype=tl.int32), axis=0)  # a scalar tensor: it changes inside runtime ifs
        for a in tl.static_range(BLOCK_A):
            if a < A:
                best = tl.max(work, axis=0)
                idx = tl.min(tl.where(work == best, offs_e, BLOCK_E), axis=0)  # lowest index among equals
                work = tl.where(offs_e == idx, float("-inf"), work)
                uncached = tl.load(slot_of_id_ptr + base + idx) < 0
                take = uncached & (count < B)
                picked = tl.where((offs_b == count) & take, idx.to(tl.int64), picked)
                count += take.to(tl.int32)
        tl.store(out_ptr + t * stride_o + offs_b, picked, mask=offs_b < B)

    _KERNEL = _prefetch_pick_kernel
    return _KERNEL


def prefetch_pick(logits: torch.Tensor, slot_of_id: torch.Tensor, layer: int, top_k: int, per_token: int) -> torch.Tensor:
    """logits [T, E] (predictor output for ``layer``) · slot_of_id [L*E] int32 (the cache table) ->
    [T, per_token] int64 expert ids to prefetch (-1 = none), one launch (module docstring)."""
    import triton

    T, E = logits.shape
    _check(logits, top_k, per_token)
    out = torch.empty((T, per_token), dtype=torch.int64, device=logits.device)
    if T:
        _pick_kernel()[(T,)](
            logits, slot_of_id, out,
            layer * E, E, top_k, per_token, logits.stride(0), out.stride(0),
            BLOCK_E=triton.next_power_of_2(E), BLOCK_A=triton.next_power_of_2(top_k),
            BLOCK_B=triton.next_power_of_2(per_token), num_warps=4 if E >= 128 else 1,
        )
    return out


def _check(logits: torch.Tensor, top_k: int, per_token: int) -> None:
    E = logits.shape[-1]
    if logits.dim() != 2 or logits.stride(-1) != 1 or not 0 < per_token <= top_k <= E:
        raise ValueError(f"prefetch_pick: logits {tuple(logits.shape)} (stride {logits.stride()}) needs [T, E] with a "
                         f"contiguous last dim and 0 < per_token={per_token} <= top_k={top_k} <= E")


def prefetch_pick_reference(logits: torch.Tensor, slot_of_id: torch.Tensor, layer: int, top_k: int,
                            per_token: int) -> torch.Tensor:
    """Pure-torch twin of :func:`prefetch_pick` (same arguments and result)."""
    _check(logits, top_k, per_token)
    T, E = logits.shape
    ranked = torch.topk(logits.float(), top_k, dim=-1).indices  # [T, A], most likely first
    uncached = slot_of_id[layer * E + ranked] < 0  # [T, A]
    rank = torch.cumsum(uncached.long(), dim=-1) - 1  # position among the uncached
    keep = uncached & (rank < per_token)
    out = torch.full((T, per_token + 1), -1, dtype=torch.int64, device=logits.device)  # column B: the discards
    out.scatter_(1, torch.where(keep, rank, per_token), torch.where(keep, ranked, -1))
    return out[:, :per_token]

"""ensure_experts_hybrid: ensure_experts that fetches only F of a layer's M misses (docs/design.md §1, §3);
the other M-F misses are routed to the CPU executor. Triton kernel + pure-torch reference, bit for bit.

Dimension legend: T tokens · A experts per token · N = T*A routes · E experts per layer · S slots.

One call for one layer (decode: no chunks — every miss is either fetched or computed by the CPU):
  1. split (this file's kernel): the present experts are the ids in ``topk_ids [T, A]`` (< 0 skipped);
     hits are those with a slot, misses the rest (M). F is computed on the device from the Q16 fetch
     fraction (no host round trip, graph-capturable): lo = floor(M·f), F = lo or lo+1, whichever has the
     smaller max(F·(1-f), (M-F)·f); then F = min(F, max_fetch) if max_fetch >= 0 and F <= S - hits
     (free slots). The fetched misses are the F with the *lowest expert ids* (deterministic), or with
     ``lfu`` (--moe-cache-policy lfu) the F routed to most often so far (``uses``; ties to the lower id);
     with ``prefer`` (a peer tier's table ``[L*E]``, >= 0 where a peer GPU holds the expert: docs/multi-gpu.md)
     the misses it names come first, so the fetched ones are peer copies before host copies.
     Every present expert then counts one use. Outputs:
     ``gpu_ids`` = topk_ids with the CPU's routes set to -1, ``cpu_ids`` = the CPU's expert ids, else -1;
     the layer's ``misses`` counter gets the unfetched M-F (so misses counts all M, uncapped);
  2. ensure_experts (kernels/ensure_experts.py, reused as is, its use count off) on ``gpu_ids``: hits keep
     their slots, the F misses take the victim slots and become copy jobs; counters hits += hits,
     misses += F, fetched += F.
So after a call ``misses`` holds the uncapped and ``fetched`` the capped miss counts; routes in
``slot_ids`` are a slot (GPU: hit or fetched) or -1 (CPU or skipped) and each valid route is in exactly
one of ``slot_ids >= 0`` / ``cpu_ids >= 0``.

Triton is imported and the kernel defined on first launch only: CPU test runs set TRITON_INTERPRET in
tests/kernels/conftest.py, after the engine (which imports this module for the reference) was collected.
"""

from __future__ import annotations

import torch

from kernels.ensure_experts_ref import USE_CAP, CacheState, _check, count_uses_, ensure_experts_reference

Q16 = 1 << 16


def _check_split(state: CacheState, layer: int, topk_ids: torch.Tensor, f_q16: torch.Tensor,
                 use_cap: int = USE_CAP) -> None:
    _check(state, layer, topk_ids, 0, use_cap)
    # on a GPU f_q16 may also live in pinned host memory (read through UVA): the host then updates it
    # with a plain store, no CUDA call (safe while another thread captures a graph)
    where_ok = f_q16.device == topk_ids.device or (f_q16.device.type == "cpu" and f_q16.is_pinned())
    if f_q16.shape != (1,) or f_q16.dtype != torch.int32 or not where_ok:
        raise ValueError(f"ensure_experts_hybrid: f_q16 must be an int32 [1] tensor on {topk_ids.device} or pinned "
                         f"(the Q16 fetch fraction), got {tuple(f_q16.shape)} {f_q16.dtype} on {f_q16.device}")


# ---------------------------------------------------------------------------------------------------
# Pure-torch reference
# ---------------------------------------------------------------------------------------------------


def split_misses_reference(state: CacheState, layer: int, topk_ids: torch.Tensor, f_q16: torch.Tensor,
                           max_fetch: int = -1, lfu: bool = False, use_cap: int = USE_CAP,
                           prefer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring: topk_ids [T, A] -> (gpu_ids [T, A], cpu_ids [T, A]) int64;
    adds the unfetched misses to ``state.misses[layer]``."""
    _check_split(state, layer, topk_ids, f_q16, use_cap)
    E, S = state.num_experts, state.num_slots
    ids = topk_ids.reshape(-1).long()  # [N]
    valid = (ids >= 0) & (ids < E)
    present = torch.zeros(E, dtype=torch.bool, device=ids.device)
    present[ids[valid]] = True
    cur = state.slot_of_id[layer * E: (layer + 1) * E]  # [E]
    hit, miss = present & (cur >= 0), present & (cur < 0)
    M, n_hit, q = int(miss.sum()), int(hit.sum()), int(f_q16[0])
    lo = (M * q) >> 16
    F = lo if max(lo * (Q16 - q), (M - lo) * q) <= max((lo + 1) * (Q16 - q), (M - lo - 1) * q) else lo + 1
    F = min(F, M, S - n_hit)
    if max_fetch >= 0:
        F = min(F, max_fetch)
    if lfu or prefer is not None:  # [E] rank among misses: preferred, the most used (lfu), the lowest id first
        order = torch.arange(E, device=ids.device)
        if lfu:
            order = order + (USE_CAP - state.uses[layer * E: (layer + 1) * E].long()) * E
        if prefer is not None:
            order = order + (prefer[layer * E: (layer + 1) * E] < 0).long() * ((USE_CAP + 1) * E)
        miss_rank = ((order[None, :] < order[:, None]) & miss[None, :]).sum(1)
    else:  # [E] rank among misses: ascending id
        missed = miss.long()
        miss_rank = torch.cumsum(missed, 0) - missed
    on_cpu = miss & (miss_rank >= F)  # [E]
    route_cpu = valid & on_cpu[ids.clamp(0, E - 1)]  # [N]
    minus = torch.full_like(ids, -1)
    gpu_ids = torch.where(valid & ~route_cpu, ids, minus).view(topk_ids.shape)
    cpu_ids = torch.where(route_cpu, ids, minus).view(topk_ids.shape)
    state.misses[layer] += M - F
    count_uses_(state, layer, present, use_cap)
    return gpu_ids, cpu_ids


def ensure_experts_hybrid_reference(state: CacheState, layer: int, topk_ids: torch.Tensor, f_q16: torch.Tensor,
                                    max_fetch: int = -1, lfu: bool = False, use_cap: int = USE_CAP,
                                    prefer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch twin of :func:`ensure_experts_hybrid` (same arguments, same results bit for bit)."""
    gpu_ids, cpu_ids = split_misses_reference(state, layer, topk_ids, f_q16, max_fetch, lfu, use_cap, prefer)
    return ensure_gpu_routes(state, layer, gpu_ids, lfu, use_cap, use_kernel=False), cpu_ids


# ---------------------------------------------------------------------------------------------------
# Triton kernel (defined on first use)
# ---------------------------------------------------------------------------------------------------

_KERNEL = None


def _split_kernel():
    global _KERNEL, triton, tl, experts_present, count_uses  # module globals: the JIT resolves names there
    if _KERNEL is not None:
        return _KERNEL
    import triton
    import triton.language as tl
    from kernels.ensure_experts import count_uses, experts_present

    # layer and N (= T x A routes) change per call: not specialized (one compile, the routes' block being
    # fixed, which the start-up warm-up meets at one layer; specialized, layer 1, layers % 16 and N % 16 were
    # variants of their own)
    @triton.jit(do_not_specialize=["layer", "N"])
    def _split_misses_kernel(
        # cache tables (read) and counters (accumulated)
        slot_of_id_ptr, misses_ptr, work_ptr, uses_ptr, prefer_ptr,
        # this call: routes in, the two route sets out, the Q16 fraction
        topk_ids_ptr, gpu_ids_ptr, cpu_ids_ptr, f_q16_ptr,
        # sizes
        layer, N, E, S, max_fetch, n_uses,
        # meta-parameters
        BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, LFU: tl.constexpr, USE_CAP: tl.constexpr,
        PREFER: tl.constexpr,
    ):
        base = layer * E
        e_idx = tl.arange(0, BLOCK_E)
        e_mask = e_idx < E
        present = experts_present(topk_ids_ptr, work_ptr, N, E, BLOCK_N, BLOCK_E)
        cur = tl.load(slot_of_id_ptr + base + e_idx, mask=e_mask, other=-1)
        hit = present & (cur >= 0)
        miss = present & (cur < 0)
        M = tl.sum(miss.to(tl.int64), axis=0)
        n_hit = tl.sum(hit.to(tl.int64), axis=0)
        # F from the Q16 fraction: the integer neighbour of M*f with the smaller slower side
        q = tl.load(f_q16_ptr).to(tl.int64)
        lo = (M * q) >> 16
        cost_lo = tl.maximum(lo * (65536 - q), (M - lo) * q)
        cost_hi = tl.maximum((lo + 1) * (65536 - q), (M - lo - 1) * q)
        F = tl.where(cost_lo <= cost_hi, lo, lo + 1)
        F = tl.minimum(tl.minimum(F, M), S - n_hit)
        F = tl.where(max_fetch >= 0, tl.minimum(F, max_fetch), F)
        if LFU or PREFER:  # rank among misses: preferred, the most used (lfu), the lowest id first
            order = e_idx.to(tl.int64)
            if LFU:
                used = tl.load(uses_ptr + base + e_idx, mask=e_mask, other=0).to(tl.int64)
                order += (USE_CAP - used) * E
            if PREFER:
                peer = tl.load(prefer_ptr + base + e_idx, mask=e_mask, other=-1)
                order += tl.where(peer < 0, (USE_CAP + 1) * E, 0).to(tl.int64)
            before = (order[None, :] < order[:, None]) & miss[None, :]  # [BLOCK_E, BLOCK_E]
            miss_rank = tl.sum(before.to(tl.int32), axis=1)
        else:  # rank among misses: ascending id
            missed = miss.to(tl.int32)
            miss_rank = tl.cumsum(missed, axis=0) - missed
        on_cpu = miss & (miss_rank >= F)
        tl.store(work_ptr + e_idx, on_cpu.to(tl.int32), mask=e_mask)
        tl.debug_barrier()
        for n0 in range(0, N, BLOCK_N):
            n_idx = n0 + tl.arange(0, BLOCK_N)
            ids = tl.load(topk_ids_ptr + n_idx, mask=n_idx < N, other=-1)
            valid = (n_idx < N) & (ids >= 0) & (ids < E)
            flag = tl.load(work_ptr + ids, mask=valid, other=0, cache_modifier=".cg")  # 1 = CPU expert
            tl.store(gpu_ids_ptr + n_idx, tl.where(valid & (flag == 0), ids, -1), mask=n_idx < N)
            tl.store(cpu_ids_ptr + n_idx, tl.where(valid & (flag != 0), ids, -1), mask=n_idx < N)
        tl.store(misses_ptr + layer, tl.load(misses_ptr + layer) + (M - F))
        count_uses(uses_ptr, base, present, e_idx, e_mask, n_uses, BLOCK_E, USE_CAP)

    _KERNEL = _split_misses_kernel
    return _KERNEL


def split_misses(state: CacheState, layer: int, topk_ids: torch.Tensor, f_q16: torch.Tensor, max_fetch: int = -1,
                 lfu: bool = False, use_cap: int = USE_CAP, prefer: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring on the device, one launch (arguments as :func:`ensure_experts_hybrid`)
    -> (gpu_ids [T, A] in topk_ids' dtype, cpu_ids [T, A] int64). The CPU's share is known from here on:
    hybrid hands it to the CPU before step 2 runs, so the CPU does not wait for the slot assignment."""
    from kernels.ensure_experts import ROUTES_BLOCK
    from kernels.cpu_handoff import host_arg

    _check_split(state, layer, topk_ids, f_q16, use_cap)
    kernel = _split_kernel()
    T, A = topk_ids.shape
    ids = topk_ids.contiguous()
    gpu_ids = torch.empty((T, A), dtype=ids.dtype, device=ids.device)
    cpu_ids = torch.empty((T, A), dtype=torch.int64, device=ids.device)
    N, E = T * A, state.num_experts
    kernel[(1,)](
        state.slot_of_id, state.misses, state.work, state.uses, state.uses if prefer is None else prefer,
        ids, gpu_ids, cpu_ids, host_arg(kernel, f_q16) if f_q16.device != ids.device else f_q16,
        layer, N, E, state.num_slots, max_fetch, state.uses.numel(),
        BLOCK_N=ROUTES_BLOCK, BLOCK_E=triton.next_power_of_2(E), LFU=lfu,
        USE_CAP=use_cap,  # the miss ranking only needs it above every count, which it is
        PREFER=prefer is not None,
    )
    return gpu_ids, cpu_ids


def ensure_gpu_routes(state: CacheState, layer: int, gpu_ids: torch.Tensor, lfu: bool = False, use_cap: int = USE_CAP,
                      use_kernel: bool = True) -> torch.Tensor:
    """Step 2: ensure_experts on the split's ``gpu_ids`` (use counts already taken by step 1) -> slot_ids
    [T, A] int64 (the Triton kernel, or with ``use_kernel=False`` the reference)."""
    slot_ids = torch.empty(gpu_ids.shape, dtype=torch.int64, device=gpu_ids.device)
    if use_kernel:
        from kernels.ensure_experts import ensure_experts

        ensure_experts(state, layer, gpu_ids, slot_ids, lfu=lfu, count_uses=False, use_cap=use_cap)
    else:
        ensure_experts_reference(state, layer, gpu_ids, slot_ids, lfu=lfu, count_uses=False, use_cap=use_cap)
    return slot_ids


def ensure_experts_hybrid(state: CacheState, layer: int, topk_ids: torch.Tensor, f_q16: torch.Tensor,
                          max_fetch: int = -1, lfu: bool = False, use_cap: int = USE_CAP,
                          prefer: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher. topk_ids [T, A] expert ids of ``layer`` (-1 = skip) · f_q16 [1] int32 on the device
    (Q16 fetch fraction) · max_fetch (-1 = no cap, 0 = every miss on the CPU) -> (slot_ids [T, A] int64: the
    GPU slot of each hit/fetched route else -1, cpu_ids [T, A] int64: the expert of each CPU route else
    -1). ``state`` is updated in place; the copy jobs are those of the fetched misses. ``prefer``: [L*E] int32
    on the device, misses with an entry >= 0 fetched first (a peer tier's table)."""
    gpu_ids, cpu_ids = split_misses(state, layer, topk_ids, f_q16, max_fetch, lfu, use_cap, prefer)
    return ensure_gpu_routes(state, layer, gpu_ids, lfu, use_cap), cpu_ids

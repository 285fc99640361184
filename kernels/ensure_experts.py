"""ensure_experts: the device-side LRU of the expert slot cache (docs/design.md §3) as a Triton kernel; its
pure-torch reference, which agrees bit for bit, and the CacheState it works on are in ensure_experts_ref.py.

Dimension legend: T tokens · A experts per token · N = T*A routes · E experts per layer · L MoE layers ·
S cache slots · C experts handled per call (one chunk, C <= min(E, S)).

One call handles one layer (and one chunk of its unique experts, see below):
  1. the unique experts of the step are the ids present in ``topk_ids [T, A]`` (ids < 0 are skipped);
  2. they are ranked in ascending expert id; this call takes ranks [chunk*C, chunk*C + C) — a prefill whose
     unique experts do not all fit in the cache runs ceil(min(E, N)/C) chunks, each call a new "step";
  3. hits keep their slot and get ``last_use = now``; misses take the least-recently-used slots whose
     ``last_use != now`` (empty slots first, then smallest ``last_use``, ties to the lowest slot index),
     assigned in ascending expert id; the evicted expert's ``slot_of_id`` entry becomes -1. With ``lfu``
     (--moe-cache-policy lfu) the slot's priority is its expert's ``uses`` first, ``last_use`` second;
  4. ``slot_ids [T, A]`` = the slot of each route whose expert is in the chunk, else -1;
  5. copy jobs ``(job_src[i] = flat expert id layer*E+e, job_dst[i] = slot)`` for i < job_count, and the
     per-layer counters hits/misses/fetched are accumulated; ``clock`` advances by one; with
     ``count_uses`` the chunk's experts count one use each (hybrid counts them in its split instead,
     where the CPU's experts are still in sight).

Everything stays on the device with fixed shapes (no host round trip): the kernel is one program, fine at
decode (N = T*A is small) and linear in N for prefill. The clock makes every call a distinct LRU time, so
protecting "slots used by this step" is simply ``last_use == now``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.ensure_experts_ref import USE_CAP, USE_SHIFT, CacheState, check_args  # noqa: F401
from kernels.ensure_experts_ref import ensure_experts_reference, num_chunks  # noqa: F401 (re-exported)

# routes are read in blocks of this fixed size, so a step of any number of tokens runs the one compiled variant
# (a block per power of two of T x top-k compiled a new variant for each new prompt size, on a request's path);
# 256 lanes cost a decode step's 8 routes nothing in these single-program kernels
ROUTES_BLOCK = 256


@triton.jit
def count_uses(uses_ptr, base, routed, e_idx, e_mask, n_uses, BLOCK_E: tl.constexpr, USE_CAP: tl.constexpr):
    """uses[base + e] += routed[e] over the layer's [BLOCK_E] tile; then, if a count reached USE_CAP, all
    ``n_uses`` counts (every layer's) halved, [BLOCK_E] at a time (as ensure_experts_ref.count_uses_).
    Shared by the ensure kernels."""
    counts = tl.load(uses_ptr + base + e_idx, mask=e_mask, other=0) + routed.to(tl.int32)
    tl.store(uses_ptr + base + e_idx, counts, mask=e_mask)
    if tl.max(counts, axis=0) >= USE_CAP:  # rare: once per ~USE_CAP / 2 routes to the hottest expert
        tl.debug_barrier()
        for i0 in range(0, n_uses, BLOCK_E):
            idx = i0 + e_idx
            # .cg: read through L2, never a stale L1 line of what this program just wrote
            old = tl.load(uses_ptr + idx, mask=idx < n_uses, other=0, cache_modifier=".cg")
            tl.store(uses_ptr + idx, old >> 1, mask=idx < n_uses)


@triton.jit
def experts_present(topk_ids_ptr, work_ptr, N, E, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_E] bool: which of the E experts the N routes at ``topk_ids_ptr`` name (ids outside [0, E)
    skipped), through the [E] int32 scratch at ``work_ptr``: zeroed, then 1 scattered per route (duplicate
    routes write the same value). Shared by the ensure kernels (this file, ensure_experts_hybrid.py)."""
    e_idx = tl.arange(0, BLOCK_E)
    e_mask = e_idx < E
    tl.store(work_ptr + e_idx, tl.zeros([BLOCK_E], dtype=tl.int32), mask=e_mask)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        n_idx = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(topk_ids_ptr + n_idx, mask=n_idx < N, other=-1).to(tl.int32)
        valid = (n_idx < N) & (ids >= 0) & (ids < E)
        tl.store(work_ptr + ids, tl.full([BLOCK_N], 1, tl.int32), mask=valid)
    tl.debug_barrier()
    # .cg: read through L2, never a stale L1 line of what this program just wrote
    return tl.load(work_ptr + e_idx, mask=e_mask, other=0, cache_modifier=".cg") != 0


# layer, N and the chunk bounds change from call to call: one compiled variant for all of them
@triton.jit(do_not_specialize=["layer", "N", "chunk_lo", "chunk_size"])
def _ensure_experts_kernel(
    # cache tables (read-write)
    slot_of_id_ptr, id_of_slot_ptr, last_use_ptr, clock_ptr,
    # this call: routes in, slots and jobs out, counters accumulated
    topk_ids_ptr, slot_ids_ptr, job_src_ptr, job_dst_ptr, job_count_ptr,
    hits_ptr, misses_ptr, fetched_ptr, work_ptr, uses_ptr,
    # sizes
    layer, N, E, S, chunk_lo, chunk_size, n_uses,
    # meta-parameters
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr, LFU: tl.constexpr,
    COUNT_USES: tl.constexpr, USE_SHIFT: tl.constexpr, USE_CAP: tl.constexpr,
):
    PROTECTED: tl.constexpr = 1 << 46  # = ensure_experts_ref._PROTECTED
    now = tl.load(clock_ptr) + 1
    base = layer * E

    # 1. presence of each expert
    e_idx = tl.arange(0, BLOCK_E)
    e_mask = e_idx < E
    present = experts_present(topk_ids_ptr, work_ptr, N, E, BLOCK_N, BLOCK_E)
    p_int = present.to(tl.int32)
    rank = tl.cumsum(p_int, axis=0) - p_int  # [BLOCK_E] exclusive rank in ascending expert id
    in_chunk = present & (rank >= chunk_lo) & (rank < chunk_lo + chunk_size)

    # 2. hits keep their slot and are stamped `now` (which protects them from eviction below).
    cur = tl.load(slot_of_id_ptr + base + e_idx, mask=e_mask, other=-1)  # [BLOCK_E] int32
    hit = in_chunk & (cur >= 0)
    miss = in_chunk & (cur < 0)
    n_hit = tl.sum(hit.to(tl.int32), axis=0)
    n_miss = tl.sum(miss.to(tl.int32), axis=0)
    tl.store(last_use_ptr + cur, tl.zeros([BLOCK_E], dtype=tl.int64) + now, mask=hit)
    tl.debug_barrier()

    # 3. LRU victims, one per miss: empty slots (priority -1) first, then the oldest last_use, ties to the
    #    lowest slot index — one min over key = priority * 2^16 + slot (unique; S <= 2^16, priorities
    #    < 2^46) per miss. The i-th miss in ascending expert id gets the i-th victim.
    s_idx = tl.arange(0, BLOCK_S)
    s_mask = s_idx < S
    lu = tl.load(last_use_ptr + s_idx, mask=s_mask, other=0, cache_modifier=".cg")  # [BLOCK_S] int64
    owner = tl.load(id_of_slot_ptr + s_idx, mask=s_mask, other=-1)  # [BLOCK_S] int32
    if LFU:  # fewest uses first, then least recent
        owner_uses = tl.load(uses_ptr + owner, mask=s_mask & (owner >= 0), other=0).to(tl.int64)
        prio = tl.where(owner < 0, -1, (owner_uses << USE_SHIFT) | (lu & ((1 << USE_SHIFT) - 1)))
    else:
        prio = tl.where(owner < 0, -1, lu)
    prio = tl.where((lu == now) | (s_idx >= S), PROTECTED, prio)
    key = prio * 65536 + s_idx  # [BLOCK_S] int64
    # the misses compacted into the scratch (its presence flags were read before the last barrier)
    m_int = miss.to(tl.int32)
    miss_rank = tl.cumsum(m_int, axis=0) - m_int
    tl.store(work_ptr + miss_rank, e_idx, mask=miss)
    tl.debug_barrier()
    new_slot = cur
    taken = s_idx < 0  # all False
    for i in range(0, n_miss):
        victim = (tl.min(key, axis=0) & 65535).to(tl.int32)
        e_i = tl.load(work_ptr + i, cache_modifier=".cg")
        old = tl.sum(tl.where(s_idx == victim, owner, 0), axis=0)
        flat = base + e_i
        # the evicted expert loses its slot: in the register tile if it is of this layer, else in memory
        old_here = (old >= base) & (old < base + E)
        new_slot = tl.where(old_here & (e_idx == old - base), -1, new_slot)
        tl.store(slot_of_id_ptr + old, -1, mask=(old >= 0) & (old_here == 0))
        new_slot = tl.where(e_idx == e_i, victim, new_slot)
        key = tl.where(s_idx == victim, PROTECTED * 65536, key)
        owner = tl.where(s_idx == victim, flat, owner)
        taken = taken | (s_idx == victim)
        tl.store(job_src_ptr + i, flat)
        tl.store(job_dst_ptr + i, victim)
    tl.debug_barrier()  # every read of the compacted misses done before step 4 rewrites the scratch
    tl.store(id_of_slot_ptr + s_idx, owner, mask=taken)
    tl.store(last_use_ptr + s_idx, tl.zeros([BLOCK_S], dtype=tl.int64) + now, mask=taken)
    tl.store(slot_of_id_ptr + base + e_idx, new_slot, mask=e_mask & (new_slot != cur))

    # 4. rewrite routes to slots through the scratch (slot of an in-chunk expert, else -1).
    tl.store(work_ptr + e_idx, tl.where(in_chunk, new_slot, -1), mask=e_mask)
    tl.debug_barrier()
    for n0 in range(0, N, BLOCK_N):
        n_idx = n0 + tl.arange(0, BLOCK_N)
        ids = tl.load(topk_ids_ptr + n_idx, mask=n_idx < N, other=-1).to(tl.int32)
        valid = (n_idx < N) & (ids >= 0) & (ids < E)
        slot = tl.load(work_ptr + ids, mask=valid, other=-1, cache_modifier=".cg")
        tl.store(slot_ids_ptr + n_idx, tl.where(valid, slot, -1), mask=n_idx < N)

    # 5. counters and clock
    tl.store(hits_ptr + layer, tl.load(hits_ptr + layer) + n_hit)
    tl.store(misses_ptr + layer, tl.load(misses_ptr + layer) + n_miss)
    tl.store(fetched_ptr + layer, tl.load(fetched_ptr + layer) + n_miss)
    tl.store(job_count_ptr, n_miss)
    tl.store(clock_ptr, now)
    if COUNT_USES:
        count_uses(uses_ptr, base, in_chunk, e_idx, e_mask, n_uses, BLOCK_E, USE_CAP)


def ensure_experts(state: CacheState, layer: int, topk_ids: torch.Tensor, slot_ids: torch.Tensor | None = None,
                   chunk: int = 0, lfu: bool = False, count_uses: bool = True, use_cap: int = USE_CAP) -> torch.Tensor:
    """Triton launcher. topk_ids [T, A] (expert ids of ``layer``, -1 = skip) -> slot_ids [T, A] int32
    (slot of each route in this chunk, else -1); ``state`` is updated in place (module docstring)."""
    check_args(state, layer, topk_ids, chunk, use_cap)
    T, A = topk_ids.shape
    if slot_ids is None:
        slot_ids = torch.empty((T, A), dtype=torch.int32, device=topk_ids.device)
    ids = topk_ids.contiguous()
    N, E, S, C = T * A, state.num_experts, state.num_slots, state.chunk_capacity
    BLOCK_S = triton.next_power_of_2(S)
    _ensure_experts_kernel[(1,)](
        state.slot_of_id, state.id_of_slot, state.last_use, state.clock,
        ids, slot_ids, state.job_src, state.job_dst, state.job_count,
        state.hits, state.misses, state.fetched, state.work, state.uses,
        layer, N, E, S, chunk * C, C, state.uses.numel(),
        BLOCK_N=ROUTES_BLOCK, BLOCK_E=triton.next_power_of_2(E), BLOCK_S=BLOCK_S,
        LFU=lfu, COUNT_USES=count_uses, USE_SHIFT=USE_SHIFT, USE_CAP=use_cap,
        num_warps=4 if BLOCK_S <= 2048 else 8 if BLOCK_S <= 8192 else 16,
    )
    return slot_ids



"""Slot-cache state and the pure-torch reference of ensure_experts (the algorithm is described in
kernels/ensure_experts.py). Kept apart from the Triton kernel so that importing the cache never defines
a ``@triton.jit`` function: Triton reads TRITON_INTERPRET when a kernel is defined, and CPU test runs set
it in tests/kernels/conftest.py, after collection has imported the engine."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

# Priority of a slot that must not be evicted (hit or already taken in this call). Above any LRU time
# (the clock counts calls: 2^46 is decades of decode) and small enough for the kernel's key priority * 2^16.
_PROTECTED = 1 << 46
# One program holds all S slots in registers; beyond this the kernel would need a blocked LRU scan.
MAX_SLOTS = 1 << 16
# lfu (--moe-cache-policy): a slot's priority is uses << USE_SHIFT | (last_use mod 2^USE_SHIFT), below
# _PROTECTED as long as uses < USE_CAP. When a count of any layer reaches USE_CAP, the counts of every
# layer are halved: old traffic fades, and all layers keep one scale, since their slots are one pool that
# eviction compares across layers (halving one layer alone made its experts look half as used as the
# others'; benchmarks/sim_expert_cache.py, with caps low enough to age: 0.1-4.6 % fewer misses than halving
# per layer; docs/results/history.md). The cap is the caller's (``use_cap``, --moe-cache-lfu-cap), at most
# USE_CAP so that uses << USE_SHIFT stays below _PROTECTED; USE_CAP ages only in long-running servers, and
# faster aging helped some traces and hurt others. The clock's low 36 bits wrap after ~2^36 calls (about a
# year of decode at 24 layers x 100 tok/s), which only reorders equal counts once.
USE_CAP = 1 << 10
USE_SHIFT = 36


@dataclass
class CacheState:
    """Every device tensor of the slot cache that the ensure kernels read or write.

    slot_of_id [L*E] int32 (-1 = not cached) · id_of_slot [S] int32 (-1 = empty) · last_use [S] int64 ·
    clock [1] int64 (LRU time of the last call) · job_src / job_dst [C] int32 + job_count [1] int32 (the
    copy jobs of the last call) · hits / misses / fetched [L] int64 (accumulated, read on demand) ·
    work [E] int32 (scratch of the Triton kernel) · uses [L*E] int32 (calls that routed to each expert,
    all halved when one reaches USE_CAP: the lfu policy's counts).
    """

    slot_of_id: torch.Tensor
    id_of_slot: torch.Tensor
    last_use: torch.Tensor
    clock: torch.Tensor
    job_src: torch.Tensor
    job_dst: torch.Tensor
    job_count: torch.Tensor
    hits: torch.Tensor
    misses: torch.Tensor
    fetched: torch.Tensor
    work: torch.Tensor
    uses: torch.Tensor

    @staticmethod
    def allocate(num_layers: int, num_experts: int, num_slots: int, device: torch.device | str) -> "CacheState":
        """An empty cache: no expert cached, every slot empty, counters zero."""
        L, E, S = num_layers, num_experts, num_slots
        if not 0 < S <= MAX_SLOTS:
            raise ValueError(f"expert cache: {S} slots; the ensure kernel supports 1..{MAX_SLOTS}")
        C = min(E, S)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        return CacheState(
            slot_of_id=torch.full((L * E,), -1, **i32), id_of_slot=torch.full((S,), -1, **i32),
            last_use=torch.zeros(S, **i64), clock=torch.zeros(1, **i64),
            job_src=torch.zeros(C, **i32), job_dst=torch.zeros(C, **i32), job_count=torch.zeros(1, **i32),
            hits=torch.zeros(L, **i64), misses=torch.zeros(L, **i64), fetched=torch.zeros(L, **i64),
            work=torch.zeros(E, **i32), uses=torch.zeros(L * E, **i32),
        )

    @property
    def num_experts(self) -> int:
        return self.work.shape[0]

    @property
    def num_slots(self) -> int:
        return self.id_of_slot.shape[0]

    @property
    def chunk_capacity(self) -> int:
        """C: the most experts one call can handle (and the job buffer's capacity)."""
        return self.job_src.shape[0]

    def clone(self) -> "CacheState":
        return CacheState(**{f.name: getattr(self, f.name).clone() for f in fields(self)})


def check_use_cap(use_cap: int) -> None:
    """The lfu cap fits the eviction key (below USE_CAP's bits) and counts at all (2 or more)."""
    if not 2 <= use_cap <= USE_CAP:
        raise ValueError(f"ensure_experts: use_cap must be in [2, {USE_CAP}], got {use_cap}")


def check_args(state: CacheState, layer: int, topk_ids: torch.Tensor, chunk: int, use_cap: int = USE_CAP) -> None:
    check_use_cap(use_cap)
    L = state.hits.shape[0]
    if not 0 <= layer < L:
        raise ValueError(f"ensure_experts: layer {layer} out of range [0, {L})")
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ensure_experts: topk_ids must be [T, A] int32/int64, got {tuple(topk_ids.shape)} {topk_ids.dtype}")
    if topk_ids.device != state.slot_of_id.device:
        raise ValueError(f"ensure_experts: topk_ids on {topk_ids.device}, cache tables on {state.slot_of_id.device}")
    if chunk < 0:
        raise ValueError(f"ensure_experts: chunk must be >= 0, got {chunk}")



_check = check_args  # the earlier name, still imported by kernels/ensure_experts_hybrid.py

def num_chunks(state: CacheState, num_routes: int) -> int:
    """How many calls a layer needs for ``num_routes`` (= T*A) routes: ceil(min(E, N) / C), a function of
    the shape only, so a captured graph has a fixed number of calls."""
    C = state.chunk_capacity
    return max(1, -(-min(state.num_experts, num_routes) // C))


# ---------------------------------------------------------------------------------------------------
# Pure-torch reference (same algorithm, step by step; used on CPU devices and by the tests)
# ---------------------------------------------------------------------------------------------------


def count_uses_(state: CacheState, layer: int, routed: torch.Tensor, use_cap: int = USE_CAP) -> None:
    """uses[layer] += routed ([E] bool); then, if one of them reached use_cap, every layer's uses halved."""
    E = state.num_experts
    counts = state.uses[layer * E: (layer + 1) * E]
    counts += routed.int()
    if int(counts.max()) >= use_cap:
        state.uses.bitwise_right_shift_(1)


def ensure_experts_reference(state: CacheState, layer: int, topk_ids: torch.Tensor,
                             slot_ids: torch.Tensor | None = None, chunk: int = 0, lfu: bool = False,
                             count_uses: bool = True, use_cap: int = USE_CAP) -> torch.Tensor:
    """Pure-torch twin of :func:`ensure_experts` (same arguments, same results bit for bit)."""
    check_args(state, layer, topk_ids, chunk, use_cap)
    E, C = state.num_experts, state.chunk_capacity
    base = layer * E
    now = int(state.clock[0]) + 1
    ids = topk_ids.reshape(-1).long()  # [N]
    valid = (ids >= 0) & (ids < E)
    present = torch.zeros(E, dtype=torch.bool, device=ids.device)
    present[ids[valid]] = True
    p_int = present.int()
    rank = torch.cumsum(p_int, 0) - p_int  # [E]
    in_chunk = present & (rank >= chunk * C) & (rank < chunk * C + C)

    cur = state.slot_of_id[base: base + E].clone()  # [E] int32
    hit, miss = in_chunk & (cur >= 0), in_chunk & (cur < 0)
    state.last_use[cur[hit].long()] = now
    prio = state.last_use
    if lfu:  # fewest uses first, then least recent
        uses = state.uses[state.id_of_slot.clamp(min=0).long()].long()
        prio = (uses << USE_SHIFT) | (state.last_use & ((1 << USE_SHIFT) - 1))
    prio = torch.where(state.id_of_slot < 0, torch.full_like(prio, -1), prio)  # [S]
    prio[state.last_use == now] = _PROTECTED
    new_slot = cur.clone()
    miss_experts = torch.nonzero(miss).flatten().tolist()
    for i, e in enumerate(miss_experts):
        victim = int(torch.nonzero(prio == prio.min())[0])  # lowest slot index among the oldest
        old = int(state.id_of_slot[victim])
        if base <= old < base + E:
            new_slot[old - base] = -1
        elif old >= 0:
            state.slot_of_id[old] = -1
        new_slot[e] = victim
        prio[victim] = _PROTECTED
        state.id_of_slot[victim] = base + e
        state.last_use[victim] = now
        state.job_src[i] = base + e
        state.job_dst[i] = victim
    state.slot_of_id[base: base + E] = new_slot

    chunk_slot = torch.where(in_chunk, new_slot, torch.full_like(new_slot, -1))  # [E]
    out = torch.where(valid, chunk_slot[ids.clamp(0, E - 1)], torch.full_like(chunk_slot[:1], -1).expand_as(ids))
    if slot_ids is None:
        slot_ids = torch.empty(topk_ids.shape, dtype=torch.int32, device=topk_ids.device)
    slot_ids.copy_(out.view(topk_ids.shape))

    n_hit, n_miss = int(hit.sum()), len(miss_experts)
    state.hits[layer] += n_hit
    state.misses[layer] += n_miss
    state.fetched[layer] += n_miss
    state.job_count[0] = n_miss
    state.clock[0] = now
    if count_uses:
        count_uses_(state, layer, in_chunk, use_cap)
    return slot_ids

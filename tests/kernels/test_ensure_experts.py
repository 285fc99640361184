"""ensure_experts: the Triton kernel (interpreted without a GPU) against the pure-torch reference, bit for
bit on random tables, plus the LRU semantics checked on hand-made cases."""

import dataclasses

import pytest
import torch

from kernels.ensure_experts import USE_CAP, CacheState, ensure_experts, ensure_experts_reference, num_chunks


def random_state(L: int, E: int, S: int, cached: int, device, gen: torch.Generator) -> CacheState:
    """A consistent cache with ``cached`` random experts in random slots and random (tied) LRU times."""
    st = CacheState.allocate(L, E, S, "cpu")
    cached = min(cached, S, L * E)
    ids = torch.randperm(L * E, generator=gen)[:cached].int()
    slots = torch.randperm(S, generator=gen)[:cached].int()
    st.slot_of_id[ids.long()] = slots
    st.id_of_slot[slots.long()] = ids
    st.last_use[:] = torch.randint(0, 6, (S,), generator=gen)  # few values: many ties; empty slots too
    st.clock[0] = 6
    st.hits[:] = torch.randint(0, 100, (L,), generator=gen)
    st.uses[:] = torch.randint(USE_CAP - 8, USE_CAP, (L * E,), generator=gen)  # ties, and halving near the cap
    st.uses[torch.rand(L * E, generator=gen) < 0.5] = 1
    return CacheState(**{f.name: getattr(st, f.name).to(device) for f in dataclasses.fields(st)})


def assert_same(a: CacheState, b: CacheState) -> None:
    for f in dataclasses.fields(CacheState):
        if f.name == "work":  # the kernel's scratch
            continue
        x, y = getattr(a, f.name).cpu(), getattr(b, f.name).cpu()
        assert torch.equal(x, y), f"{f.name}: kernel {x.tolist()} != reference {y.tolist()}"


def assert_consistent(st: CacheState) -> None:
    """slot_of_id and id_of_slot are inverse maps."""
    for s, i in enumerate(st.id_of_slot.tolist()):
        if i >= 0:
            assert int(st.slot_of_id[i]) == s
    for i, s in enumerate(st.slot_of_id.tolist()):
        if s >= 0:
            assert int(st.id_of_slot[s]) == i


# (L, E, S, T, A, cached): odd sizes, S < E (chunks), S > L*E, T = 1 and T = 33
CASES = [
    (1, 4, 4, 1, 2, 0),
    (3, 7, 5, 1, 2, 5),
    (2, 16, 16, 33, 4, 16),
    (4, 12, 40, 33, 3, 30),
    (1, 8, 3, 2, 3, 3),
    (3, 64, 100, 1, 8, 100),
    (2, 33, 200, 33, 5, 20),
    (5, 9, 11, 3, 9, 11),
]


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "lfu"])
@pytest.mark.parametrize("L,E,S,T,A,cached", CASES)
def test_kernel_matches_reference(L, E, S, T, A, cached, lfu, device):
    gen = torch.Generator().manual_seed(L * 1000 + E * 10 + S)
    state = random_state(L, E, S, cached, device, gen)
    ref = state.clone()
    for step in range(4):  # the state evolves: later steps see earlier evictions
        layer = int(torch.randint(0, L, (1,), generator=gen))
        ids = torch.randint(-1, E, (T, A), generator=gen)  # -1 = a route computed elsewhere
        ids = ids.to(device=device, dtype=torch.int32 if step % 2 else torch.int64)
        for chunk in range(num_chunks(state, T * A)):
            got = ensure_experts(state, layer, ids, chunk=chunk, lfu=lfu)
            want = ensure_experts_reference(ref, layer, ids, chunk=chunk, lfu=lfu)
            assert torch.equal(got.cpu(), want.cpu()), f"step {step} chunk {chunk}"
            assert_same(state, ref)
    assert_consistent(ref)


def test_all_hit_all_miss_and_repeated_ids(device):
    L, E, S = 2, 8, 8
    state = CacheState.allocate(L, E, S, device)
    ref = state.clone()
    ids = torch.tensor([[3, 3], [5, 3], [5, 5]], device=device)  # repeated ids, within and across tokens
    for expected_hits, expected_misses in ((0, 2), (2, 2)):  # all miss, then all hit
        got = ensure_experts(state, 1, ids)
        want = ensure_experts_reference(ref, 1, ids)
        assert torch.equal(got.cpu(), want.cpu())
        assert_same(state, ref)
        assert int(ref.hits[1]) == expected_hits and int(ref.misses[1]) == expected_misses
    assert int(ref.job_count[0]) == 0  # the all-hit step copies nothing
    slot3, slot5 = int(ref.slot_of_id[E + 3]), int(ref.slot_of_id[E + 5])
    assert got.cpu().tolist() == [[slot3, slot3], [slot5, slot3], [slot5, slot5]]


def run_both(state, ref, layer, ids, lfu=False):
    got = ensure_experts(state, layer, ids, lfu=lfu)
    want = ensure_experts_reference(ref, layer, ids, lfu=lfu)
    assert torch.equal(got.cpu(), want.cpu())
    assert_same(state, ref)
    return want


def test_lru_order_and_empty_slots_first(device):
    E, S = 6, 3
    state = CacheState.allocate(1, E, S, device)
    ref = state.clone()
    col = lambda *e: torch.tensor([[x] for x in e], device=device)  # noqa: E731
    run_both(state, ref, 0, col(0))  # empty slots first, lowest index: expert 0 -> slot 0
    run_both(state, ref, 0, col(1))  # -> slot 1
    run_both(state, ref, 0, col(2))  # -> slot 2
    run_both(state, ref, 0, col(0))  # hit refreshes expert 0; expert 1 is now the oldest
    run_both(state, ref, 0, col(3))  # evicts expert 1 (slot 1)
    assert ref.slot_of_id.tolist() == [0, -1, 2, 1, -1, -1]
    assert ref.job_src[: int(ref.job_count[0])].tolist() == [3] and ref.job_dst[:1].tolist() == [1]


@pytest.mark.parametrize("lfu, evicted", [(False, 0), (True, 1)])
def test_lfu_evicts_the_least_used_then_the_oldest(lfu, evicted, device):
    """Expert 0 is routed to three times, 1 and 2 once each (2 last): a fourth expert evicts 0 under lru
    (the least recent) and 1 under lfu (fewest uses, then the older of 1 and 2)."""
    E, S = 6, 3
    state = CacheState.allocate(1, E, S, device)
    ref = state.clone()
    for e in (0, 0, 0, 1, 2, 3):
        run_both(state, ref, 0, torch.tensor([[e]], device=device), lfu)
    assert int(ref.slot_of_id[evicted]) == -1
    assert sorted(e for e in range(4) if int(ref.slot_of_id[e]) >= 0) == sorted({0, 1, 2, 3} - {evicted})
    assert ref.uses.tolist() == [3, 1, 1, 1, 0, 0]  # one use per call that routed to the expert


@pytest.mark.parametrize("cap", [USE_CAP, 12])
def test_use_counts_halve_at_the_cap_in_every_layer(cap, device):
    """Once a count reaches the cap (the default, or --moe-cache-lfu-cap's), every layer's counts are halved:
    old traffic fades, on one scale for the one slot pool (3 layers of 3 experts: the kernel halves the
    table in [4]-wide blocks, the last partial). Below the cap nothing is halved."""
    state = CacheState.allocate(3, 3, 4, device)
    state.uses[:] = torch.tensor([cap - 2, 10, 3, cap - 1, 7, 6, 5, 0, 1], dtype=torch.int32, device=device)
    ref = state.clone()

    def call(ids):
        ids = torch.tensor(ids, device=device)
        got = ensure_experts(state, 0, ids, use_cap=cap)
        assert torch.equal(got.cpu(), ensure_experts_reference(ref, 0, ids, use_cap=cap).cpu())
        assert_same(state, ref)

    call([[0, 2]])
    assert ref.uses.tolist() == [cap - 1, 10, 4, cap - 1, 7, 6, 5, 0, 1]  # layer 1's cap - 1 is not its
    call([[0]])
    assert ref.uses.tolist() == [cap // 2, 5, 2, (cap - 1) // 2, 3, 3, 2, 0, 0]


@pytest.mark.parametrize("cap", [1, USE_CAP + 1])
def test_a_cap_outside_the_key_is_refused(cap, device):
    """A count must stay below the eviction key's recency bits (USE_CAP) and a cap of 1 would never count."""
    state = CacheState.allocate(1, 4, 4, device)
    for ensure in (ensure_experts, ensure_experts_reference):
        with pytest.raises(ValueError, match="use_cap"):
            ensure(state, 0, torch.tensor([[0]], device=device), use_cap=cap)


def test_step_experts_are_never_evicted(device):
    E, S = 8, 4
    state = CacheState.allocate(1, E, S, device)
    ref = state.clone()
    run_both(state, ref, 0, torch.tensor([[0, 1, 2, 3]], device=device))
    run_both(state, ref, 0, torch.tensor([[1, 2, 3, 0]], device=device))  # all hit, same time
    # expert 0 is the oldest by slot tie-break, but it is used by this step: only the others may go
    out = run_both(state, ref, 0, torch.tensor([[0, 5]], device=device))
    assert int(ref.slot_of_id[0]) == 0 and out.tolist()[0][0] == 0
    assert int(ref.slot_of_id[5]) == 1  # the lowest slot among the equally old unprotected ones
    assert int(ref.slot_of_id[1]) == -1


def test_chunks_cover_every_route_once(device):
    L, E, S, T, A = 2, 8, 3, 4, 2
    state = CacheState.allocate(L, E, S, device)
    ref = state.clone()
    ids = torch.tensor([[7, 0], [1, 6], [2, 5], [3, 4]], device=device)  # 8 unique experts > 3 slots
    n = num_chunks(ref, T * A)
    assert n == 3
    seen = torch.zeros(T, A, dtype=torch.int32)
    for chunk in range(n):
        got = ensure_experts(state, 1, ids, chunk=chunk)
        want = ensure_experts_reference(ref, 1, ids, chunk=chunk)
        assert torch.equal(got.cpu(), want.cpu())
        assert_same(state, ref)
        routed = want.cpu() >= 0
        seen += routed.int()
        # the routes of this chunk point at slots that now hold their expert
        for t, a in routed.nonzero().tolist():
            assert int(ref.id_of_slot[int(want[t, a])]) == E + int(ids[t, a])
    assert seen.eq(1).all()
    assert int(ref.hits[1]) + int(ref.misses[1]) == 8

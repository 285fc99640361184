"""ensure_experts_hybrid: the Triton kernels (interpreted without a GPU) against the pure-torch reference,
bit for bit, plus the split semantics: F from the Q16 rule (services.engine.moe.split, an independent
integer implementation), lowest expert ids fetched, every valid route on exactly one side."""

import pytest
import torch

from kernels.ensure_experts_hybrid import ensure_experts_hybrid, ensure_experts_hybrid_reference
from kernels.ensure_experts_ref import USE_CAP, CacheState
from services.engine.moe.split import Q16, fetch_count_q16, fraction_to_q16
from tests.kernels.test_ensure_experts import assert_consistent, assert_same, random_state

# (L, E, S, T, A, cached): decode-sized steps, odd sizes, a tiny cache, a cache bigger than L*E
CASES = [
    (1, 4, 4, 1, 2, 0),
    (3, 7, 5, 1, 2, 5),
    (2, 16, 16, 4, 4, 16),
    (4, 12, 40, 3, 3, 30),
    (1, 8, 3, 2, 3, 3),
    (3, 64, 100, 1, 8, 100),
    (2, 33, 200, 5, 5, 20),
]
FRACTIONS = [0, fraction_to_q16(0.3), fraction_to_q16(0.41), Q16 // 2, fraction_to_q16(0.77), Q16]


def q16(value: int, device) -> torch.Tensor:
    return torch.tensor([value], dtype=torch.int32, device=device)


def routes(T, A, E, gen, device, drop=0.2):
    """Distinct experts per token (as top-k gives), some routes -1 (computed elsewhere)."""
    ids = torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(T)])
    ids[torch.rand(T, A, generator=gen) < drop] = -1
    return ids.to(device)


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "lfu"])
@pytest.mark.parametrize("max_fetch", [-1, 0, 1, 3])
@pytest.mark.parametrize("L,E,S,T,A,cached", CASES)
def test_kernel_matches_reference(L, E, S, T, A, cached, max_fetch, lfu, device):
    gen = torch.Generator().manual_seed(L * 1000 + E * 10 + S + max_fetch)
    state = random_state(L, E, S, cached, device, gen)
    ref = state.clone()
    for step in range(5):  # the state evolves across steps and layers
        layer = int(torch.randint(0, L, (1,), generator=gen))
        ids = routes(T, min(A, E), E, gen, device)
        if step % 2:
            ids = ids.int()
        f = q16(FRACTIONS[(step + E) % len(FRACTIONS)], device)
        got_slots, got_cpu = ensure_experts_hybrid(state, layer, ids, f, max_fetch, lfu=lfu)
        want_slots, want_cpu = ensure_experts_hybrid_reference(ref, layer, ids, f, max_fetch, lfu=lfu)
        assert torch.equal(got_slots.cpu(), want_slots.cpu()), f"step {step} slot_ids"
        assert torch.equal(got_cpu.cpu(), want_cpu.cpu()), f"step {step} cpu_ids"
        assert_same(state, ref)
    assert_consistent(ref)


@pytest.mark.parametrize("f_q16", FRACTIONS)
@pytest.mark.parametrize("max_fetch", [-1, 0, 2])
def test_split_semantics(f_q16, max_fetch, device):
    L, E, S, T, A = 2, 32, 20, 3, 6
    gen = torch.Generator().manual_seed(f_q16 + max_fetch)
    state = random_state(L, E, S, 10, device, gen)
    ref = state.clone()
    layer = 1
    ids = routes(T, A, E, gen, device)
    before = ref.clone()
    cached = before.slot_of_id[layer * E:(layer + 1) * E].cpu()  # [E]
    present = sorted(set(ids[ids >= 0].tolist()))
    misses = [e for e in present if cached[e] < 0]
    hits = [e for e in present if cached[e] >= 0]
    F = min(fetch_count_q16(len(misses), f_q16, max_fetch), S - len(hits))
    slots, cpu = ensure_experts_hybrid(state, layer, ids, q16(f_q16, device), max_fetch)
    want_slots, want_cpu = ensure_experts_hybrid_reference(ref, layer, ids, q16(f_q16, device), max_fetch)
    assert torch.equal(slots.cpu(), want_slots.cpu()) and torch.equal(cpu.cpu(), want_cpu.cpu())
    assert_same(state, ref)
    slots, cpu, ids = slots.cpu(), cpu.cpu(), ids.cpu()
    valid = ids >= 0
    # each valid route on exactly one side; skipped routes on none
    assert torch.equal((slots >= 0) | (cpu >= 0), valid) and not ((slots >= 0) & (cpu >= 0)).any()
    assert torch.equal(cpu[cpu >= 0], ids[cpu >= 0])
    # the fetched misses are the F lowest ids; the rest of the misses go to the CPU
    assert sorted(set(cpu[cpu >= 0].tolist())) == misses[F:]
    assert ref.job_src[: int(ref.job_count[0])].cpu().tolist() == [layer * E + e for e in misses[:F]]
    # GPU routes point at slots holding their expert
    for t, a in (slots >= 0).nonzero().tolist():
        assert int(ref.id_of_slot[int(slots[t, a])]) == layer * E + int(ids[t, a])
    # counters: misses uncapped (M), fetched capped (F)
    assert int(ref.misses[layer] - before.misses[layer]) == len(misses)
    assert int(ref.fetched[layer] - before.fetched[layer]) == F
    assert int(ref.hits[layer] - before.hits[layer]) == len(hits)


def test_all_on_cpu_leaves_the_cache_untouched(device):
    E, S = 8, 4
    state = CacheState.allocate(1, E, S, device)
    ref = state.clone()
    ids = torch.tensor([[0, 5], [3, -1]], device=device)
    slots, cpu = ensure_experts_hybrid(state, 0, ids, q16(Q16, device), max_fetch=0)
    want_slots, want_cpu = ensure_experts_hybrid_reference(ref, 0, ids, q16(Q16, device), max_fetch=0)
    assert torch.equal(slots.cpu(), want_slots.cpu()) and torch.equal(cpu.cpu(), want_cpu.cpu())
    assert_same(state, ref)
    assert (want_slots < 0).all() and want_cpu.cpu().tolist() == [[0, 5], [3, -1]]
    assert (ref.id_of_slot < 0).all() and int(ref.job_count[0]) == 0
    assert int(ref.misses[0]) == 3 and int(ref.fetched[0]) == 0


def test_fetch_is_capped_by_free_slots(device):
    """f = 1 with more misses than unprotected slots: the overflow goes to the CPU instead of failing."""
    E, S = 16, 3
    state = CacheState.allocate(1, E, S, device)
    ref = state.clone()
    ids = torch.tensor([[9, 2, 7, 4, 11]], device=device)
    got = ensure_experts_hybrid(state, 0, ids, q16(Q16, device))
    want = ensure_experts_hybrid_reference(ref, 0, ids, q16(Q16, device))
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    assert_same(state, ref)
    assert sorted(want[1][want[1] >= 0].tolist()) == [9, 11] and int(ref.fetched[0]) == 3


def test_rejects_a_host_fraction(device):
    state = CacheState.allocate(1, 4, 4, device)
    with pytest.raises(ValueError, match="f_q16"):
        ensure_experts_hybrid_reference(state, 0, torch.zeros(1, 2, dtype=torch.int64, device=device),
                                        torch.tensor([0.5]))


def test_lfu_fetches_the_most_used_misses(device):
    """lfu: of a step's misses the most used are fetched (ties: lowest id), the rest go to the CPU; every
    present expert counts one use; kernel == reference."""
    E, S = 8, 8
    state = CacheState.allocate(1, E, S, device)
    state.uses[:] = torch.tensor([0, 5, 2, 9, 5, 0, 0, 0], dtype=torch.int32, device=device)
    ref = state.clone()
    ids = torch.tensor([[0, 1, 2, 3, 4]], device=device)  # all miss; uses 0, 5, 2, 9, 5
    got = ensure_experts_hybrid(state, 0, ids, q16(Q16, device), max_fetch=2, lfu=True)
    want = ensure_experts_hybrid_reference(ref, 0, ids, q16(Q16, device), max_fetch=2, lfu=True)
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    assert_same(state, ref)
    fetched = sorted(e for e in range(E) if int(ref.slot_of_id[e]) >= 0)
    assert fetched == [1, 3]  # 3 (9 uses), then 1 and 4 tie at 5: the lower id
    assert sorted(e for e in want[1].flatten().tolist() if e >= 0) == sorted({0, 1, 2, 3, 4} - set(fetched))
    assert ref.uses.tolist() == [1, 6, 3, 10, 6, 0, 0, 0]


@pytest.mark.parametrize("cap", [USE_CAP, 12])
def test_the_split_halves_every_layers_counts_at_the_cap(cap, device):
    """The split counts the step's uses (the ensure after it does not again): when one reaches the cap,
    all layers' counts halve, as in kernels/ensure_experts.py; kernel == reference."""
    state = CacheState.allocate(2, 3, 6, device)
    state.uses[:] = torch.tensor([4, cap - 1, 0, 9, 2, 1], dtype=torch.int32, device=device)
    ref = state.clone()
    ids = torch.tensor([[1, 2]], device=device)
    got = ensure_experts_hybrid(state, 0, ids, q16(Q16 // 2, device), lfu=True, use_cap=cap)
    want = ensure_experts_hybrid_reference(ref, 0, ids, q16(Q16 // 2, device), lfu=True, use_cap=cap)
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    assert_same(state, ref)
    assert ref.uses.tolist() == [2, cap // 2, 0, 4, 1, 0]


@pytest.mark.parametrize("lfu", [False, True], ids=["lru", "lfu"])
@pytest.mark.parametrize("L,E,S,T,A,cached", CASES)
def test_preferred_misses_are_fetched_first(L, E, S, T, A, cached, lfu, device):
    """``prefer`` (a peer tier's table): of the misses, those it names are fetched before any other; kernel ==
    reference bit for bit as the state evolves."""
    gen = torch.Generator().manual_seed(L * 7 + E + S)
    state = random_state(L, E, S, cached, device, gen)
    ref = state.clone()
    prefer = torch.where(torch.rand(L * E, generator=gen) < 0.4, 0, -1).int().to(device)  # [L*E]
    for step in range(5):
        layer = int(torch.randint(0, L, (1,), generator=gen))
        ids = routes(T, min(A, E), E, gen, device)
        f = q16(FRACTIONS[(step + E) % len(FRACTIONS)], device)
        before = ref.slot_of_id[layer * E: (layer + 1) * E].clone()
        got = ensure_experts_hybrid(state, layer, ids, f, lfu=lfu, prefer=prefer)
        want = ensure_experts_hybrid_reference(ref, layer, ids, f, lfu=lfu, prefer=prefer)
        assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want)), f"step {step}"
        assert_same(state, ref)
        present = {e for e in ids.flatten().tolist() if e >= 0}
        misses = {e for e in present if int(before[e]) < 0}
        on_cpu = {e for e in want[1].flatten().tolist() if e >= 0}
        fetched = misses - on_cpu
        preferred = {e for e in misses if int(prefer[layer * E + e]) >= 0}
        # a non-preferred miss is fetched only when every preferred one is
        assert not (fetched - preferred) or preferred <= fetched, f"step {step}"
    assert_consistent(ref)

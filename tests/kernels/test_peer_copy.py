"""copy_tiered: the fused two-source copy (interpreted without a GPU) against the per-job torch copy and the
expected slot contents: a job whose expert a peer holds is copied from that peer slot, any other from the
host bank; peer jobs are counted per layer."""

import pytest
import torch

from kernels.gather_copy import CopyPlan
from kernels.peer_copy import check_plans, copy_tiered_fused, copy_tiered_reference
from tests.kernels.test_gather_copy import make_banks


def peer_banks(host, K, P, device, gen):
    """K pools of P slots, each filled with random values (not the host's: a wrong source shows)."""
    return [{k: torch.randn((P, *v.shape[1:]), generator=gen).to(v.dtype).to(device) for k, v in host[0].items()}
            for _ in range(K)]


# (L, E, S, D, I, dtype, K, P, jobs): 16-byte sizes, odd sizes (byte path), a bank over one 64 KiB chunk
CASES = [
    (3, 5, 7, 8, 4, torch.float32, 1, 6, 4),
    (2, 6, 9, 5, 3, torch.bfloat16, 2, 3, 6),
    (2, 4, 5, 96, 96, torch.float32, 2, 2, 3),
    (1, 3, 3, 5, 7, torch.float32, 1, 2, 0),
]


@pytest.mark.parametrize("L,E,S,D,I,dtype,K,P,n", CASES)
def test_fused_matches_reference(L, E, S, D, I, dtype, K, P, n, device):
    gen = torch.Generator().manual_seed(S * 31 + n + K)
    host, slots_a = make_banks(L, E, S, D, I, dtype, device, gen)
    slots_b = {k: v.clone() for k, v in slots_a.items()}
    peers = peer_banks(host, K, P, device, gen)
    C = min(E, S)
    job_src = torch.randperm(L * E, generator=gen)[:C].int().to(device)
    job_dst = torch.randperm(S, generator=gen)[:C].int().to(device)
    job_count = torch.tensor([n], dtype=torch.int32, device=device)
    # the peer tier holds K*P random experts (some jobs' experts among them, some not)
    held = torch.randperm(L * E, generator=gen)[: K * P]
    table = torch.full((L * E,), -1, dtype=torch.int32)
    table[held] = torch.randperm(K * P, generator=gen).int()
    table = table.to(device)
    counts = []
    for slots, copy in ((slots_a, copy_tiered_fused), (slots_b, copy_tiered_reference)):
        host_plan, peer_plan = CopyPlan(host, slots), CopyPlan(peers, slots)
        check_plans(host_plan, peer_plan)
        fetched = torch.zeros(L, dtype=torch.int64, device=device)
        copy(host_plan, peer_plan, job_src, job_dst, job_count, table, fetched)
        counts.append(fetched.cpu())
    if device.type == "cuda":
        torch.cuda.synchronize()
    jobs = list(zip(job_src[:n].tolist(), job_dst[:n].tolist()))
    want_count = torch.zeros(L, dtype=torch.int64)
    for flat, _ in jobs:
        if int(table[flat]) >= 0:
            want_count[flat // E] += 1
    assert torch.equal(counts[0], want_count) and torch.equal(counts[1], want_count)
    copied = {slot: flat for flat, slot in jobs}
    for name in slots_a:
        a, b = slots_a[name].cpu(), slots_b[name].cpu()
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        for s in range(S):
            if s in copied:
                f = copied[s]
                g = int(table[f])
                want = peers[g // P][name][g % P] if g >= 0 else host[f // E][name][f % E]
            else:  # no job: untouched
                want = torch.full_like(a[s], -7.0)
            assert torch.equal(a[s].view(torch.uint8), want.cpu().view(torch.uint8)), f"{name} slot {s}"


def test_plans_must_target_the_same_slots():
    host = [{"gate_up": torch.zeros(2, 4, 3), "down": torch.zeros(2, 3, 2)}]
    slots = {"gate_up": torch.zeros(3, 4, 3), "down": torch.zeros(3, 3, 2)}
    other = {k: v.clone() for k, v in slots.items()}
    peers = [{"gate_up": torch.zeros(2, 4, 3), "down": torch.zeros(2, 3, 2)}]
    with pytest.raises(ValueError, match="peer copy"):
        check_plans(CopyPlan(host, slots), CopyPlan(peers, other))

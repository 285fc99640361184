"""The three-way split (peer GPU, host PCIe, CPU) of services/engine/moe/peer_split.py: a hand-worked case,
optimality against every partition enumerated independently, the two-path model as its special case, and
the controller's wiring (torch-free)."""

from __future__ import annotations

import itertools

import pytest

from services.engine.moe.peer_split import (Partition, PeerSplitController, ThreeWayCostModel, path_times,
                                            three_way_partition)
from services.engine.moe.split import CostModel, SplitController

B = 9_437_184  # one Qwen3-30B-A3B bf16 expert
GB = 1e9


def test_hand_worked_case():
    """8 misses all on the peer; P2P 400, PCIe 50, CPU 70 GB/s, no c_sync. (6,1,1) takes B/50 on PCIe,
    (8,0,0) 8B/400 = B/50 too; (7,0,1) takes max(7B/400, B/70) = 7B/400, the best."""
    part = three_way_partition(8, 8, B, 400 * GB, 50 * GB, 70 * GB)
    assert (part.peer, part.host, part.cpu) == (7, 0, 1)
    assert part.seconds == pytest.approx(7 * B / (400 * GB))


def brute_force(M, Mp, p2p, pcie, cpu, c_sync):
    """Every (P, H, C) with P <= Mp, its max path time, written out again (no shared loop)."""
    out = []
    for P, H, C in itertools.product(range(M + 1), repeat=3):
        if P + H + C != M or P > Mp:
            continue
        t_cpu = (C * B / cpu + c_sync) if C else 0.0
        out.append((max(P * B / p2p, H * B / pcie, t_cpu), P, H, C))
    return out


@pytest.mark.parametrize("M,Mp", [(1, 0), (1, 1), (5, 2), (8, 8), (9, 3), (16, 10)])
@pytest.mark.parametrize("rates", [(400, 50, 70, 20e-6), (60, 50, 70, 20e-6), (400, 50, 10, 300e-6),
                                   (30, 50, 100, 0.0)])
def test_partition_is_optimal(M, Mp, rates):
    p2p, pcie, cpu, c_sync = rates
    part = three_way_partition(M, Mp, B, p2p * GB, pcie * GB, cpu * GB, c_sync)
    assert part.peer + part.host + part.cpu == M and part.peer <= Mp
    assert part.seconds == pytest.approx(max(path_times(part.peer, part.host, part.cpu, B, p2p * GB, pcie * GB,
                                                        cpu * GB, c_sync)))
    best = min(t for t, *_ in brute_force(M, Mp, p2p * GB, pcie * GB, cpu * GB, c_sync))
    assert part.seconds == pytest.approx(best, rel=1e-9)


def test_no_cpu_path_and_bad_input():
    part = three_way_partition(6, 2, B, 400 * GB, 50 * GB, None)
    assert part.cpu == 0 and part.peer == 2 and part.host == 4
    with pytest.raises(ValueError):
        three_way_partition(3, 4, B, 400 * GB, 50 * GB, 70 * GB)


@pytest.mark.parametrize("M", [1, 3, 6, 8, 12])
@pytest.mark.parametrize("c_sync", [0.0, 25e-6, 400e-6])
def test_without_peer_held_misses_it_is_the_two_path_model(M, c_sync):
    """No miss on the peer: the best time equals the two-path model's best integer F (checked over all F)."""
    pcie, cpu = 50 * GB, 70 * GB
    part = three_way_partition(M, 0, B, 400 * GB, pcie, cpu, c_sync)
    two = CostModel(B, pcie, cpu, c_sync)
    assert part.peer == 0
    assert part.seconds == pytest.approx(min(max(two.t_fetch(F), two.t_cpu(M, F) if M - F else 0.0)
                                             for F in range(M + 1)))


def test_fraction_is_the_fetched_share():
    model = ThreeWayCostModel(B, 50 * GB, 70 * GB, 0.0, p2p_bps=400 * GB, peer_share=1.0)
    assert model.balanced_fraction(8) == pytest.approx(7 / 8)  # the hand-worked case
    # everything on a fast peer with a slow CPU: fetch all (f = 1, no CPU submit)
    slow_cpu = ThreeWayCostModel(B, 50 * GB, 5 * GB, 50e-6, p2p_bps=400 * GB, peer_share=1.0)
    assert slow_cpu.balanced_fraction(6) == 1.0
    # no miss on the peer: close to the two-path fraction
    none = ThreeWayCostModel(B, 50 * GB, 70 * GB, 0.0, p2p_bps=400 * GB, peer_share=0.0)
    assert none.balanced_fraction(12) == pytest.approx(CostModel(B, 50 * GB, 70 * GB).balanced_fraction(12), abs=1 / 12)


class FakeTier:
    def __init__(self, share):
        self.peer_share, self.p2p_gbps = share, {"cuda:1": 400.0, "cuda:2": 300.0}


def test_controller_reads_pcie_off_the_host_share():
    tier = FakeTier(0.5)
    ctl = PeerSplitController(B, tier, prior_fraction=0.5)
    assert isinstance(ctl, SplitController) and ctl.p2p_bps == 300 * GB  # the slowest link
    # 48 layers x 4 fetched: half from the peer; the copy time is the 96 host experts' at 50 GB/s
    ctl.observe(layers=48, misses=48 * 8, fetched=48 * 4, fetch_s=96 * B / (50 * GB), cpu_experts=48 * 4,
                cpu_s=48 * 4 * B / (70 * GB))
    assert ctl.pcie_bps == pytest.approx(50 * GB)
    assert ctl.target == pytest.approx(ctl.cost_model().balanced_fraction(8))
    assert isinstance(ctl.cost_model(), ThreeWayCostModel) and ctl.stats()["peer_share"] == 0.5
    assert Partition(1, 2, 3, 0.0).fetched == 3

"""The split with a peer tier: three paths for a layer's misses (docs/design.md §1, docs/multi-gpu.md).

Per decode step and MoE layer, M experts miss the home slots, each B bytes; the peer tier holds M_p of them.
P (<= M_p) are copied from a peer GPU, H over PCIe from the host banks, C = M - P - H computed by the CPU
executor in place, all three at once:

    t_peer = P·B / p2p        t_host = H·B / pcie_ov        t_cpu = C·B / cpu_ov + c_sync  (c_sync if C > 0)

and the layer's misses take max(t_peer, t_host, t_cpu). ``three_way_partition`` finds the integer (P, H, C)
with the smallest maximum. A peer-held miss may still go over PCIe or to the CPU (every expert is in the
host banks) when the peer link would finish last; with NVLink (p2p ~ 10x PCIe) that only happens when
nearly every miss is on the peer.

On the device the split kernel reads one fraction f = (P + H) / M: the share of misses fetched (peer or
host), the rest on the CPU; it fetches the peer-held misses first (kernels/ensure_experts_hybrid.py,
``prefer``), and the fused copy takes each fetched expert from the peer when it is there.
``PeerSplitController`` is the cost-model stage of services/engine/moe/split.py with this model: it counts
the share of fetched misses that came from a peer (from the tier's counters at each placement refresh)
and reads the PCIe rate off the host part of the copies. The tuner that follows times f on step time, as
without a peer. Torch-free; units bytes, seconds, bytes/second.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.moe.split import CostModel, SplitController


@dataclass(frozen=True)
class Partition:
    peer: int  # P: copied from a peer GPU
    host: int  # H: copied from the host over PCIe
    cpu: int  # C: computed by the CPU executor
    seconds: float  # max of the three paths' times

    @property
    def fetched(self) -> int:
        return self.peer + self.host


def path_times(peer: int, host: int, cpu: int, expert_bytes: int, p2p_bps: float, pcie_bps: float,
               cpu_bps: float | None, c_sync_s: float = 0.0) -> tuple[float, float, float]:
    """(t_peer, t_host, t_cpu) of one layer's partition (module docstring); t_cpu is inf for C > 0 without
    a CPU path (cpu_bps None or 0)."""
    B = expert_bytes
    if cpu == 0:
        t_cpu = 0.0
    elif not cpu_bps:
        t_cpu = float("inf")
    else:
        t_cpu = cpu * B / cpu_bps + c_sync_s
    return peer * B / p2p_bps, host * B / pcie_bps, t_cpu


def three_way_partition(misses: int, on_peer: int, expert_bytes: int, p2p_bps: float, pcie_bps: float,
                        cpu_bps: float | None, c_sync_s: float = 0.0) -> Partition:
    """The (P, H, C) of ``misses`` (``on_peer`` of them held by a peer) with the smallest max path time.
    Exhaustive over P <= on_peer and H: M is at most T*A per layer (64 at decode), a few thousand pairs.
    Ties go to fewer CPU experts, then to fewer host copies (the busier resources)."""
    if not 0 <= on_peer <= misses:
        raise ValueError(f"three-way split: {on_peer} peer-held of {misses} misses")
    if min(p2p_bps, pcie_bps) <= 0 or expert_bytes <= 0:
        raise ValueError("three-way split: rates and expert bytes must be positive")
    best: tuple[float, int, int] | None = None  # (seconds, C, H)
    for P in range(on_peer + 1):
        for H in range(misses - P + 1):
            C = misses - P - H
            t = max(path_times(P, H, C, expert_bytes, p2p_bps, pcie_bps, cpu_bps, c_sync_s))
            near = best is not None and t <= best[0] * (1 + 1e-12)  # a tie up to fp noise
            if best is None or t < best[0] * (1 - 1e-12) or (near and (C, H) < best[1:]):
                best = (t, C, H)
    t, C, H = best
    return Partition(misses - C - H, H, C, t)


@dataclass
class ThreeWayCostModel(CostModel):
    """CostModel with the peer path: ``peer_share`` of the misses are held by a peer, copied at p2p_bps."""

    p2p_bps: float = 0.0
    peer_share: float = 0.0

    def partition(self, misses: int) -> Partition:
        on_peer = min(misses, max(0, round(misses * self.peer_share)))
        return three_way_partition(misses, on_peer, self.expert_bytes, self.p2p_bps, self.pcie_bps, self.cpu_bps,
                                   self.c_sync_s)

    def balanced_fraction(self, M: float) -> float:
        """f = (P + H) / M of the best partition at M (rounded) misses; 1.0 (no CPU work) when C = 0."""
        if M <= 0:
            return 1.0
        m = max(1, round(M))
        part = self.partition(m)
        return 1.0 if part.cpu == 0 else part.fetched / m


class PeerSplitController(SplitController):
    """SplitController whose target comes from ThreeWayCostModel. ``tier``: the PeerTier (its
    ``peer_share`` and measured ``p2p_gbps`` are read at each step)."""

    def __init__(self, expert_bytes: int, tier, **kw):
        super().__init__(expert_bytes, **kw)
        self.tier = tier

    @property
    def p2p_bps(self) -> float:
        return min(self.tier.p2p_gbps.values()) * 1e9  # the slowest peer link bounds a step

    def observe(self, *, fetched: int, fetch_s: float, **kw) -> None:
        """As SplitController.observe; the copy time is the host copies' (the peer ones run beside them,
        several times faster), so the PCIe rate is read off the host share of ``fetched``."""
        host = round(fetched * (1.0 - self.tier.peer_share))
        super().observe(fetched=host, fetch_s=fetch_s, **kw)

    def cost_model(self) -> ThreeWayCostModel:
        return ThreeWayCostModel(self.expert_bytes, self.pcie_bps, self.cpu_bps, self.c_sync_s,
                                 p2p_bps=self.p2p_bps, peer_share=self.tier.peer_share)

    def stats(self) -> dict:
        return {**super().stats(), "p2p_bytes_per_second": self.p2p_bps, "peer_share": self.tier.peer_share}


def make_split_controller(cache, expert_bytes: int, **kw) -> SplitController:
    """The hybrid's cost-model stage: three paths when ``cache`` has a peer tier, else two."""
    if cache.peer is None:
        return SplitController(expert_bytes, **kw)
    return PeerSplitController(expert_bytes, cache.peer, **kw)

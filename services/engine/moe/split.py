"""The fetch/CPU split of a hybrid step (docs/design.md §1) and the controller that corrects it online.

Per layer and step, M experts miss the GPU cache, each B bytes. F are fetched over PCIe, M-F are
computed by the CPU executor in place, both at once:

    t_fetch = F·B / pcie_ov          t_cpu = (M-F)·B / cpu_ov + c_sync   (c_sync only if M-F > 0)

The step takes max(t_fetch, t_cpu). The offline profile gives a prior (its concurrent bandwidths and
c_sync); the controller then measures per-step fetch and CPU times while serving and moves the fetch
fraction f to equalise the two sides *including c_sync* — the reference design's fixed offline ratio
ignored c_sync and picked hybrid where it was 8x slower than offload. When the CPU side cannot win
(slow CPU, large c_sync, few misses), f goes to 1: plain offload, no CPU submit at all.

Torch-free: the engine feeds it numbers; tests feed it a simulated timing model.
Units: bytes, seconds, bytes/second.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from services.common.profiles import hybrid_layer_time

Q16 = 1 << 16  # f in Q16 fixed point: the on-device split reads f_q16 = round(f * 65536)
DEFAULT_FRACTION = 0.5  # prior without a profile: half of the misses fetched, refined after one step


def fraction_to_q16(f: float) -> int:
    """f in [0, 1] -> Q16 integer in [0, 65536]."""
    return max(0, min(Q16, round(f * Q16)))


def fetch_count_q16(misses: int, f_q16: int, max_fetch: int = -1) -> int:
    """How many of ``misses`` to fetch: lo = floor(M·f) or lo+1, whichever has the smaller
    max(F·(1-f), (M-F)·f), in Q16 integer arithmetic exactly as the device kernel does it; then capped
    by ``max_fetch`` (-1 = no cap, 0 = every miss on the CPU)."""
    lo = (misses * f_q16) >> 16
    cost_lo = max(lo * (Q16 - f_q16), (misses - lo) * f_q16)
    cost_hi = max((lo + 1) * (Q16 - f_q16), (misses - lo - 1) * f_q16)
    F = min(misses, lo if cost_lo <= cost_hi else lo + 1)
    return F if max_fetch < 0 else min(F, max_fetch)


@dataclass
class CostModel:
    """The per-layer time model. Bandwidths are the *concurrent* ones (both paths compete for DRAM)."""

    expert_bytes: int  # B
    pcie_bps: float  # pcie_ov
    cpu_bps: float  # cpu_ov
    c_sync_s: float = 0.0  # fixed CPU submit + sync cost of a layer with CPU work

    def t_fetch(self, F: float) -> float:
        return F * self.expert_bytes / self.pcie_bps

    def t_cpu(self, M: float, F: float) -> float:
        return (M - F) * self.expert_bytes / self.cpu_bps + (self.c_sync_s if M - F > 0 else 0.0)

    def layer_time(self, M: float, f: float) -> float:
        """Seconds of one layer's misses at fraction f (integer F as on the device), M may be fractional:
        interpolated between the neighbouring integer miss counts."""
        if f >= 1.0:
            return self.t_fetch(M)

        def at(m: int) -> float:
            return hybrid_layer_time(m, self.expert_bytes, f, self.pcie_bps / 1e9, self.cpu_bps / 1e9, self.c_sync_s)

        lo = math.floor(M)
        w = M - lo
        return at(lo) if w == 0 else (1 - w) * at(lo) + w * at(lo + 1)

    def balanced_fraction(self, M: float) -> float:
        """f equalising t_fetch and t_cpu for M misses per layer, c_sync included:
        F·B/p = (M-F)·B/c + s  =>  F = (M·B/c + s) / (B/p + B/c). Returns 1.0 (offload) when that split
        is not faster than fetching everything."""
        if M <= 0:
            return 1.0
        B = self.expert_bytes
        F = (M * B / self.cpu_bps + self.c_sync_s) / (B / self.pcie_bps + B / self.cpu_bps)
        f = min(1.0, max(0.0, F / M))
        if f >= 1.0 or self.layer_time(M, f) >= self.t_fetch(M) * (1 - 1e-9):  # ties (fp noise): offload
            return 1.0
        return f


class SplitController:
    """Online fetch fraction: EWMA of the measured concurrent rates and misses per layer, then f moves
    toward the cost model's balanced fraction.

    observe() once per decode step with that step's totals over all layers; ``fraction`` / ``f_q16``
    is what the next step uses. While backed off to f=1 the CPU gets no work and so no measurement:
    every ``probe_every`` steps one step runs with one miss per layer on the CPU to re-measure it.
    """

    def __init__(self, expert_bytes: int, prior_fraction: float | None = None, pcie_bps: float | None = None,
                 cpu_bps: float | None = None, c_sync_s: float = 0.0, smoothing: float = 0.3,
                 gain: float = 0.5, probe_every: int = 256):
        """prior_fraction: the starting f (profile decision or DEFAULT_FRACTION) · pcie_bps / cpu_bps:
        prior concurrent rates (profile; None = unknown until measured) · c_sync_s: per-layer submit +
        sync cost · smoothing: EWMA weight of a new measurement · gain: share of the way f moves to the
        model's target per step."""
        if expert_bytes <= 0:
            raise ValueError(f"split controller: expert_bytes must be positive, got {expert_bytes}")
        self.expert_bytes = expert_bytes
        self.fraction = DEFAULT_FRACTION if prior_fraction is None else min(1.0, max(0.0, prior_fraction))
        self.pcie_bps, self.cpu_bps, self.c_sync_s = pcie_bps, cpu_bps, c_sync_s
        self.smoothing, self.gain, self.probe_every = smoothing, gain, probe_every
        self.misses_per_layer: float | None = None
        self.target: float | None = None
        self.steps = 0
        self._steps_without_cpu = 0

    @property
    def f_q16(self) -> int:
        """The fraction the device kernel reads this step (a probe step puts one miss on the CPU)."""
        if self.fraction >= 1.0 and self.probe_every and self._steps_without_cpu >= self.probe_every and self.misses_per_layer:
            m = max(1.0, self.misses_per_layer)
            return fraction_to_q16(max(0.0, 1.0 - 1.0 / (m + 1)))
        return fraction_to_q16(self.fraction)

    def _ewma(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def observe_c_sync(self, seconds: float) -> None:
        """A measured per-layer submit + sync cost (calibration or online)."""
        self.c_sync_s = self._ewma(self.c_sync_s or None, max(0.0, seconds))

    def cost_model(self) -> CostModel:
        """The model the target comes from, at the current estimates (a peer tier adds a third path:
        services/engine/moe/peer_split.py)."""
        return CostModel(self.expert_bytes, self.pcie_bps, self.cpu_bps, self.c_sync_s)

    def observe(self, *, layers: int, misses: int, fetched: int, fetch_s: float, cpu_experts: int,
                cpu_s: float, cpu_layers: int = 0, sync_s: float = 0.0) -> None:
        """One decode step, summed over its ``layers`` MoE layers: ``misses`` (M, all cache misses),
        ``fetched`` experts copied in ``fetch_s`` seconds of copy time, ``cpu_experts`` experts read by
        the CPU executor in ``cpu_s`` seconds of compute (inputs ready -> output written; c_sync apart),
        and optionally ``sync_s`` seconds of submit + sync overhead over ``cpu_layers`` handed-off layers."""
        self.steps += 1
        if cpu_layers > 0 and sync_s > 0:
            self.observe_c_sync(sync_s / cpu_layers)
        B = self.expert_bytes
        if fetched > 0 and fetch_s > 0:
            self.pcie_bps = self._ewma(self.pcie_bps, fetched * B / fetch_s)
        if cpu_experts > 0 and cpu_s > 0:
            self.cpu_bps = self._ewma(self.cpu_bps, cpu_experts * B / cpu_s)
            self._steps_without_cpu = 0
        else:
            self._steps_without_cpu += 1
        if layers > 0:
            self.misses_per_layer = self._ewma(self.misses_per_layer, misses / layers)
        if self.pcie_bps and self.cpu_bps and self.misses_per_layer:
            self.target = self.cost_model().balanced_fraction(self.misses_per_layer)
            self.fraction += self.gain * (self.target - self.fraction)
            if self.target >= 1.0 and self.fraction > 0.999:
                self.fraction = 1.0  # settle exactly: f_q16 = 65536 lets the backend skip the CPU submit
            elif abs(self.fraction - self.target) < 1e-4:
                self.fraction = self.target

    def stats(self) -> dict:
        """JSON-able state for the engine's stats."""
        return {
            "fetch_fraction": self.fraction,
            "fetch_fraction_target": self.target,
            "pcie_bytes_per_second": self.pcie_bps,
            "cpu_bytes_per_second": self.cpu_bps,
            "c_sync_seconds": self.c_sync_s,
            "misses_per_layer": self.misses_per_layer,
            "steps_observed": self.steps,
        }


class SplitTuner:
    """Searches the fetch fraction on measured decode step time, starting where the controller's cost
    model put it.

    Why: the cost model treats the PCIe and CPU rates as constants, but both paths read the same host
    DRAM, so each side's rate depends on f (H200 host: the executor reads 99 GB/s alone, 73 GB/s while
    the GPU fetches at 39). The f that equalises the two sides at the rates seen there need not be the
    fastest one, and the step time as a function of f need not have a single minimum; only the step
    time itself says which f is best.

    One window = ``window`` decode steps at one f; its cost is their median step time. Not the mean: a
    decode step now and then takes 2-3x the usual (H200 host: p99 26-38 ms against p50 13-15), and one such
    step in a window moved its mean more than the f being compared did (run 12: the same server settled
    at f 0.375, 64 tok/s, or 0.22, 77 tok/s).
    1. scan: ``grid`` plus the model's f, one window each; the fastest is kept. (A grid, not a descent
       from the model's f: with ~5 misses per layer F is a small integer, so the step time is a staircase
       in f whose flat treads stop a local search.)
    2. local search: try f + step, then f - step; a neighbour faster by ``margin`` is taken and the search
       goes on that way, otherwise the step halves and the current f is measured again (the context
       grows meanwhile).
    3. rest below ``min_step``, at the best f; scan again after ``reprobe_every`` steps (routing drifts).
    """

    def __init__(self, start: float, grid: tuple[float, ...] = tuple(i / 8 for i in range(9)), step: float = 1 / 16,
                 min_step: float = 1 / 32, window: int = 12, margin: float = 0.01, reprobe_every: int = 4096):
        self.fraction = min(1.0, max(0.0, start))  # the accepted f
        self.grid, self.first_step, self.min_step = grid, step, min_step
        self.window, self.margin, self.reprobe_every = window, margin, reprobe_every
        self.step = step
        self.cost: float | None = None  # median step seconds at the accepted f
        self.trial: float | None = None  # the f being measured when it is not the accepted one
        self.direction = 1
        self.windows = 0
        self.scanned: dict[float, float] = {}  # f -> median step seconds, of the last scan
        self.phase = "scan"  # scan -> up / down / base (local search) -> rest -> scan ...
        self._queue: list[float] = []  # fractions still to scan
        self._samples: list[float] = []  # step seconds of the window being measured
        self._rest = 0
        self._start_scan()

    @property
    def current(self) -> float:
        """The f the next step should use (a trial value while one is measured)."""
        return self.trial if self.trial is not None else self.fraction

    def observe(self, seconds: float) -> None:
        """One decode step's wall time at ``current``."""
        if self.phase == "rest":
            self._rest += 1
            if self._rest >= self.reprobe_every:
                self._start_scan()
            return
        self._samples.append(seconds)
        if len(self._samples) < self.window:
            return
        cost, self._samples = statistics.median(self._samples), []
        self.windows += 1
        if self.phase == "scan":
            self.scanned[self.trial] = cost
            if self._queue:
                self.trial = self._queue.pop(0)
                return
            self.fraction = min(self.scanned, key=self.scanned.get)
            self.cost, self.step = self.scanned[self.fraction], self.first_step
            self._try(1, "up")
        elif self.phase == "base":
            self.cost = cost
            self._try(self.direction, "up")
        elif cost < self.cost * (1 - self.margin):  # the neighbour wins: move there, keep going that way
            self.fraction, self.cost = self.trial, cost
            self._try(self.direction, self.phase)
        elif self.phase == "up":
            self._try(-self.direction, "down")
        else:
            self._halve()

    def _start_scan(self) -> None:
        self._queue = sorted(set(self.grid) | {self.fraction})
        self.scanned, self.phase, self._rest = {}, "scan", 0
        self.trial = self._queue.pop(0)

    def _try(self, direction: int, phase: str) -> None:
        trial = min(1.0, max(0.0, self.fraction + direction * self.step))
        if trial == self.fraction:  # at a bound: nothing to try that way
            if phase == "up":
                self._try(-direction, "down")
            else:
                self._halve()
            return
        self.trial, self.direction, self.phase = trial, direction, phase

    def _halve(self) -> None:
        self.trial = None
        self.step /= 2
        self.phase = "rest" if self.step < self.min_step else "base"

    def stats(self) -> dict:
        return {"fraction": self.fraction, "trial": self.trial, "step": self.step, "phase": self.phase,
                "cost_seconds_per_step": self.cost, "windows": self.windows,
                "scanned": {f"{f:.3f}": c for f, c in sorted(self.scanned.items())}}

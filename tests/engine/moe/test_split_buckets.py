"""Hybrid's split per bucket of tokens per step (services/engine/moe/split_buckets.py): the bucket of a
step and of its padded CUDA-graph batch agree, each bucket's cost model and tuner are its own and
converge to that bucket's optimum on a synthetic host whose optimum moves with T, the fraction array
changes per bucket in place, and pins hold."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine.moe.split import SplitController, fetch_count_q16, fraction_to_q16
from services.engine.moe.split_buckets import PREFILL, TUNE_AFTER_STEPS, SplitBuckets, bucket_name, next_pow2

B = 9 * 2**20  # expert bytes (Qwen3-30B-A3B bf16: ~9.4 MB)
LAYERS = 24


def make(max_decode=32, max_tokens=256, tunable=True) -> SplitBuckets:
    return SplitBuckets(lambda name: SplitController(B), max_decode, max_tokens, tunable, False, torch.device("cpu"))


def graph_sizes(max_batch: int) -> list[int]:
    """The runner's captured decode batch sizes (runtime/runner.py DecodeGraphs)."""
    return sorted({b for b in (1, 2, 4, 8) if b <= max_batch} | set(range(16, max_batch + 1, 8)) | {max_batch})


def test_bucket_names_and_bounds():
    b = make(max_decode=24, max_tokens=256)
    assert b.decode_cap == 32 and [s.name for s in b.states] == ["1", "2", "4", "8", "16", "32", PREFILL]
    assert [b.states[b.index(t)].name for t in (1, 2, 3, 5, 8, 9, 17, 32, 33, 256)] == \
        ["1", "2", "4", "8", "8", "16", "32", "32", PREFILL, PREFILL]
    assert b.index(257) is None  # a long prompt chunk: the offload path
    assert bucket_name(3, 32) == "4" and bucket_name(40, 32) == PREFILL


@pytest.mark.parametrize("max_batch", [1, 3, 8, 16, 24, 32, 40, 64])
def test_a_padded_graph_batch_is_in_the_bucket_of_its_rows(max_batch):
    """The host names a replay's bucket from its real rows n; the captured graph read the fraction of its
    padded size B's bucket: they must be the same word."""
    b = make(max_decode=max_batch)
    sizes = graph_sizes(max_batch)
    for n in range(1, max_batch + 1):
        padded = next(s for s in sizes if s >= n)
        assert b.index(n) == b.index(padded), (n, padded)


def test_fractions_are_separate_words_changed_in_place():
    b = make()
    views = [b.f_view(i) for i in range(len(b.states))]
    ptrs = [v.data_ptr() for v in views]
    b.pin("16", 1.0)
    b.pin("1", 0.25)
    assert int(views[b.by_name["16"]]) == fraction_to_q16(1.0) and int(views[0]) == fraction_to_q16(0.25)
    assert [v.data_ptr() for v in views] == ptrs  # the same addresses a captured graph holds
    assert b.states[b.by_name["16"]].stats()["mode"] == "offload" and not b.states[b.by_name["16"]].settling
    b.pin("16", None)
    assert b.states[b.by_name["16"]].settling


class TokensHost:
    """A host whose split optimum moves with the tokens per step: T tokens miss M(T) experts per layer;
    the fetch moves B bytes per miss at ``pcie``; the CPU streams B bytes per expert at ``cpu_bw`` but
    also does 2·3·B/2 flops per token routed to the expert (bf16 weights) at ``flops``, so its time per
    expert grows with the tokens per expert. A step is ``base`` plus the slower side per layer."""

    def __init__(self, pcie=50e9, cpu_bw=99e9, flops=0.6e12, c_sync=25e-6, base=3e-3, noise=0.02, seed=0):
        self.pcie, self.cpu_bw, self.flops, self.c_sync, self.base, self.noise = pcie, cpu_bw, flops, c_sync, base, noise
        self.rng = random.Random(seed)

    @staticmethod
    def misses(T: int) -> int:
        return round(5 * T ** 0.75)  # distinct missing experts grow slower than T (shared experts)

    def cpu_expert_s(self, T: int) -> float:
        per_expert_tokens = max(1.0, T / 2)  # routes to a missing expert: ~T·A over the ~2·A·T^0.75 experts present
        return B / self.cpu_bw + per_expert_tokens * 3 * B / self.flops

    def layer(self, T: int, F: int) -> tuple[float, float]:
        M = self.misses(T)
        return F * B / self.pcie, (M - F) * self.cpu_expert_s(T) + (self.c_sync if M - F else 0.0)

    def expected(self, T: int, f: float) -> float:
        F = fetch_count_q16(self.misses(T), fraction_to_q16(f))
        return self.base * T ** 0.5 + LAYERS * max(self.layer(T, F))

    def step(self, T: int, f: float) -> tuple[float, dict]:
        """(wall seconds, the controller's per-step totals)."""
        M = self.misses(T)
        F = fetch_count_q16(M, fraction_to_q16(f))
        fetch, cpu = self.layer(T, F)
        wall = self.expected(T, f) * (1 + self.rng.uniform(-self.noise, self.noise))
        totals = dict(layers=LAYERS, misses=LAYERS * M, fetched=LAYERS * F, fetch_s=LAYERS * fetch,
                      cpu_experts=LAYERS * (M - F), cpu_s=LAYERS * max(0.0, cpu - (self.c_sync if M - F else 0.0)))
        return wall, totals


def test_each_bucket_converges_to_its_own_optimum():
    host = TokensHost()
    b = make(max_decode=32)
    rng = random.Random(1)
    for _ in range(6000):  # steps of mixed sizes, interleaved as a serving engine sees them
        T = rng.choice((1, 4, 16, 32))
        i = b.index(T)
        state = b.states[i]
        wall, totals = host.step(T, state.fraction)
        state.controller.observe(**totals)
        b.observe(i, wall, T)
    best_f = {}
    for T in (1, 4, 16, 32):
        state = b.states[b.index(T)]
        assert state.tuner is not None and state.tuner.phase == "rest", T
        best = min(host.expected(T, k / 64) for k in range(65))
        assert host.expected(T, state.fraction) <= best * 1.03, (T, state.fraction)
        best_f[T] = state.fraction
        assert state.steps > TUNE_AFTER_STEPS
    # the optimum really moves with T here, and each bucket found its own: one shared f would not do
    assert best_f[32] > best_f[1] + 0.2
    assert host.expected(32, best_f[1]) > min(host.expected(32, k / 64) for k in range(65)) * 1.05
    untouched = b.states[b.by_name["2"]]
    assert untouched.steps == 0 and untouched.tuner is None and untouched.controller.steps == 0


def test_not_tunable_keeps_the_controllers_fraction():
    b = SplitBuckets(lambda name: SplitController(B, prior_fraction=0.0, gain=0.0, probe_every=0), 8, 256, False,
                     False, torch.device("cpu"))
    for _ in range(3 * TUNE_AFTER_STEPS):
        b.observe(0, 0.01, 1)
    assert b.states[0].tuner is None and b.states[0].fraction == 0.0 and int(b.f_view(0)) == 0
    assert not b.settling(1)


def test_next_pow2():
    assert [next_pow2(n) for n in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]

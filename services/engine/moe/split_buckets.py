"""Hybrid's fetch/CPU split per batch-size bucket (docs/design.md §1, "one split per step size").

Legend: T tokens in a step · A experts per token · M misses per layer.

Why per bucket: the split's optimum moves with T. Tokens of a step share an expert's bytes, so fetching
an expert costs the same at T = 1 and T = 32 while the misses per layer grow more slowly than T (top-8 of
128 experts: M ~ 5 at T = 1, ~40 at T = 16 on the issue-19 model); the CPU executor reads each of its
experts once for all the expert's tokens (csrc/executor.cpp groups routes by expert), but its arithmetic
per byte grows with the tokens per expert, so past a few tokens it stops being a pure DRAM stream. One f
for every step size is wrong for most of them, and one tuner fed steps of mixed sizes compares step
times that differ by T, not by f.

Buckets: T rounded up to a power of two, 1, 2, 4, ... up to the decode cap P = next_pow2(max running
requests); one ``prefill`` bucket for P < T <= max_tokens (prompt chunks); steps above max_tokens take
the offload path. A padded CUDA-graph batch B and its real batch n (n <= B) fall in the same bucket:
the graph sizes are powers of two up to 8, then multiples of 8 and the cap, so no power of two lies in
[n, B) and the host can name the bucket of a replay it never sees run.

Each bucket has its own SplitController (the cost model, fed that bucket's steps), its own SplitTuner
(after TUNE_AFTER_STEPS of the bucket's steps; cost = seconds per token) and its own Q16 fraction in one
int32 array (pinned host memory in graph mode: a graph of batch B reads its bucket's word through UVA,
so every bucket's f changes between replays with a plain store, no recapture). A bucket may be pinned
to a fraction (``pin``: `auto`'s per-bucket verdict, e.g. f = 1, the offload path, where offload
measured faster). Torch only for the fraction array.
"""

from __future__ import annotations

import contextlib

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from services.engine.moe.split import Q16, SplitController, SplitTuner, fraction_to_q16

TUNE_AFTER_STEPS = 24  # a bucket's steps of the cost model alone (it settles in a few) before its tuner starts
PREFILL = "prefill"


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def bucket_name(tokens: int, decode_cap: int) -> str:
    """The bucket of a step of ``tokens`` tokens (``decode_cap``: a power of two, SplitBuckets.decode_cap)."""
    return str(next_pow2(tokens)) if tokens <= decode_cap else PREFILL


def mode_of(fraction: float) -> str:
    """What a fraction does: every miss fetched (offload), every miss on the CPU (cpu), or a split."""
    return "offload" if fraction >= 1.0 else "cpu" if fraction <= 0.0 else "hybrid"


@dataclass
class BucketState:
    """One bucket: its cost model, its tuner once started, an optional pinned fraction."""

    name: str
    controller: SplitController
    tunable: bool
    tuner: SplitTuner | None = None
    pinned: float | None = None  # fixed by `auto`'s verdict: the tuner and the cost model no longer move it
    steps: int = 0  # steps observed (their wall time)
    seconds_per_token: list[float] = field(default_factory=list)  # the last few, for stats

    @property
    def fraction(self) -> float:
        """The f the bucket's next step uses (a tuner trial while one is measured)."""
        if self.pinned is not None:
            return self.pinned
        return self.tuner.current if self.tuner is not None else self.controller.fraction

    @property
    def q16(self) -> int:
        if self.pinned is not None:
            return fraction_to_q16(self.pinned)
        return fraction_to_q16(self.tuner.current) if self.tuner is not None else self.controller.f_q16

    @property
    def settling(self) -> bool:
        """True while the split of this bucket is still searched (its speed is not yet its own)."""
        return self.pinned is None and self.tunable and (self.tuner is None or self.tuner.phase != "rest")

    def observe(self, seconds: float, tokens: int) -> str | None:
        """One step of this bucket: its wall time for ``tokens`` tokens. Returns a log line when the tuner
        started or settled."""
        self.steps += 1
        self.seconds_per_token = (self.seconds_per_token + [seconds / tokens])[-32:]
        if not self.tunable or self.pinned is not None:
            return None
        if self.tuner is None:
            if self.steps >= TUNE_AFTER_STEPS:
                self.tuner = SplitTuner(self.controller.fraction)
                return f"bucket {self.name}: cost model put f at {self.tuner.fraction:.3f}; tuning it on step time"
            return None
        was = self.tuner.phase
        self.tuner.observe(seconds / tokens)
        if self.tuner.phase == "rest" and was != "rest":
            t = self.tuner
            scan = ", ".join(f"{f:.2f}: {c * 1e3:.2f}" for f, c in sorted(t.scanned.items()))
            return (f"bucket {self.name}: split settled at f={t.fraction:.3f} ({mode_of(t.fraction)}, "
                    f"{t.cost * 1e3:.2f} ms/token; cost model said {self.controller.fraction:.3f}); scan {scan}")
        return None

    def stats(self) -> dict:
        spt = sorted(self.seconds_per_token)
        f = self.fraction
        return {"mode": mode_of(f), "fetch_fraction": f, "pinned": self.pinned is not None, "steps": self.steps,
                "seconds_per_token": spt[len(spt) // 2] if spt else None,  # median of the last 32 steps
                "settling": self.settling, "controller": self.controller.stats(),
                "tuner": self.tuner.stats() if self.tuner is not None else None}


class SplitBuckets:
    """The buckets of one hybrid backend and the Q16 fraction array its split kernels read."""

    def __init__(self, make_controller: Callable[[str], SplitController], max_decode_tokens: int, max_tokens: int,
                 tunable: bool, pinned_memory: bool, device: torch.device):
        """make_controller(name): a bucket's cost model (its prior) · max_decode_tokens: the engine's most
        sequences per decode step · max_tokens: the largest step that may split (above: offload path) ·
        tunable: the tuner may move f (automatic split) · pinned_memory: the fractions live in pinned host
        memory (graph mode), else on ``device``."""
        self.decode_cap = next_pow2(max(1, max_decode_tokens))
        self.max_tokens = max(max_tokens, self.decode_cap)
        names = [str(1 << i) for i in range(self.decode_cap.bit_length())]
        if self.max_tokens > self.decode_cap:
            names.append(PREFILL)
        self.states = [BucketState(n, make_controller(n), tunable) for n in names]
        self.by_name = {s.name: i for i, s in enumerate(self.states)}
        q = torch.tensor([s.q16 for s in self.states], dtype=torch.int32)
        self.f_q16 = q.pin_memory() if pinned_memory else q.to(device)  # [buckets]
        self._written = [s.q16 for s in self.states]
        self.held = False  # all_on_cpu(): every word 0, writes deferred
        self.last: int = 0  # the bucket of the last observed step (the headline of stats)

    def index(self, tokens: int) -> int | None:
        """The bucket of a step of ``tokens`` tokens; None above max_tokens (offload path)."""
        if tokens > self.max_tokens:
            return None
        if tokens > self.decode_cap:
            return len(self.states) - 1
        return max(0, tokens - 1).bit_length()

    def f_view(self, i: int) -> torch.Tensor:
        """Bucket i's Q16 fraction as the [1] int32 tensor the split kernel reads (a view: stays valid)."""
        return self.f_q16[i:i + 1]

    def write(self, i: int) -> int:
        """Publish bucket i's current fraction to the array; returns it (Q16). Pinned: a plain store."""
        q = self.states[i].q16
        if q != self._written[i] and not self.held:
            self._written[i] = q
            self.f_q16[i] = q
        return q

    @contextlib.contextmanager
    def all_on_cpu(self):
        """Every bucket's word 0 while held (every miss on the CPU, nothing fetched; writes wait), then
        every bucket's current fraction published."""
        self.held = True
        self.f_q16.zero_()
        try:
            yield
        finally:
            self.held = False
            for i, state in enumerate(self.states):
                self._written[i] = state.q16
                self.f_q16[i] = state.q16

    def observe(self, i: int, seconds: float, tokens: int) -> str | None:
        self.last = i
        line = self.states[i].observe(seconds, tokens)
        self.write(i)
        return line

    def pin(self, name: str, fraction: float | None) -> None:
        """Fix bucket ``name`` at ``fraction`` (None: free it again)."""
        i = self.by_name[name]
        self.states[i].pinned = fraction
        self.write(i)

    def settling(self, tokens: int) -> bool:
        i = self.index(tokens)
        return i is not None and self.states[i].settling

    def stats(self) -> dict:
        """Per bucket: mode, f, steps, median seconds per token, the controller's and tuner's state."""
        return {s.name: s.stats() for s in self.states if s.steps or s.pinned is not None or s.name == "1"}

    @staticmethod
    def name_of_q16(q16: int) -> str:
        return mode_of(q16 / Q16)

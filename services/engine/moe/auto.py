"""`--moe-backend auto`: offload or hybrid, and hybrid's starting fetch fraction, from this GPU's bandwidth
profile (``services.common.profiles.decide``: predicted per-token time of both from the concurrent
bandwidths and c_sync). The profile is the prior, not the verdict: under hybrid the split controller keeps
correcting f while serving. No profile (or no GPU): offload, with a log line saying how to make one.

The profile's verdict is checked online too (the reference's known failure: an offline profile picking
hybrid where it is several times slower, e.g. when per-layer handoffs or eager launches dominate), per
bucket of tokens per step (services/engine/moe/split_buckets.py: 1, 2, 4, ... sequences): the fetch/CPU
optimum moves with the batch, so one verdict for every batch size would be wrong for some. The engine
reports each decode step's wall time (``observe_decode_step``); after a warm-up the chosen backend is
timed for TRIAL_STEPS steps (each step into its bucket), then the other one. Per bucket timed by both
(MIN_BUCKET_STEPS steps each) the faster per token wins. Hybrid is kept when it wins any bucket; the
buckets offload won are pinned to f = 1 in it (the offload path: every miss fetched), the others keep
their tuned split (its scan covers f = 0, all misses on the CPU, to f = 1); buckets neither trial saw are
decided by hybrid's per-bucket tuner alone. Offload is kept when it wins every bucket timed by both.

``reload_profile()`` re-reads the profile while serving: same backend -> hybrid's controller restarts from
the new prior; another backend -> the inner backend is rebuilt. After any rebuild the engine re-captures
its decode graphs, which hold the old backend's buffers."""

from __future__ import annotations

import gc

import torch

from services.common.logging import get_logger
from services.common.profiles import auto_backend, expected_misses_per_layer, normalize_uuid
from services.engine.config import MoEBackend
from services.engine.moe.backends import BackendContext, ExpertBackend, register_backend
from services.engine.moe.hybrid import HybridBackend
from services.engine.moe.hybrid_split import SPLIT_MAX_DECODE, profile_format, profile_prior
from services.engine.moe.offload import OffloadBackend
from services.engine.moe.sizing import CacheGeometry, decide_cache_size
from services.engine.moe.split_buckets import bucket_name, next_pow2

log = get_logger("moe.auto")

WARMUP_STEPS = 16  # decode steps ignored after a (re)build: the new cache starts empty
TRIAL_STEPS = 32  # decode steps timed per candidate (median per token, per bucket)
MIN_BUCKET_STEPS = 8  # a bucket's verdict needs this many of its steps timed under each candidate
OTHER = {MoEBackend.OFFLOAD.value: MoEBackend.HYBRID.value, MoEBackend.HYBRID.value: MoEBackend.OFFLOAD.value}


def gpu_uuid(device: torch.device) -> str | None:
    """The profile key of ``device`` (None on CPU: no GPU, no profile)."""
    if device.type != "cuda":
        return None
    return normalize_uuid(str(torch.cuda.get_device_properties(device).uuid))


class AutoBackend:
    """Delegates to an OffloadBackend or a HybridBackend chosen from the profile."""

    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        banks = ctx.banks
        self.geometry = CacheGeometry(len(banks.layers), banks.layers[0].num_experts, ctx.top_k, banks.expert_nbytes())
        # sized once: both candidates get the same slots, so a switch on reload keeps the VRAM budget
        self.num_slots = decide_cache_size(ctx.config, self.geometry, ctx.device, ctx.weight_bytes_on_device,
                                           ctx.kv_reserve_bytes).slots
        # bucket names as hybrid's (split_buckets.py)
        self.decode_cap = next_pow2(max(1, min(ctx.config.max_running_requests, SPLIT_MAX_DECODE)))
        self.decision, self.profile_path = self._decide()
        self.inner: ExpertBackend = self._build(self.decision.backend)
        self._start_trial()

    # ---- online verdict ------------------------------------------------------------------------------

    def _start_trial(self) -> None:
        self.current = self.decision.backend
        self.trial: dict[str, dict[str, float]] = {}  # backend -> bucket -> median seconds per decode token
        self.bucket_verdict: dict[str, str] = {}  # bucket -> offload | hybrid (timed by both candidates)
        self._samples: dict[str, list[float]] = {}  # bucket -> seconds per token of this trial
        self._skip = WARMUP_STEPS
        self.settled = False

    @property
    def may_rebuild(self) -> bool:
        """Until the verdict the next observe_decode_step may rebuild the inner backend, freeing what a step
        still in flight on the device uses: the engine chains no decode steps (decode overlap) until then."""
        return not self.settled

    def observe_prefill_step(self, seconds: float, tokens: int) -> None:
        """A step with prompt tokens: hybrid's prefill bucket tunes on it (not part of the verdict)."""
        inner_observe = getattr(self.inner, "observe_prefill_step", None)
        if inner_observe is not None:
            inner_observe(seconds, tokens)

    def observe_decode_step(self, seconds: float, tokens: int) -> bool:
        """One decode step's wall time for ``tokens`` sequences. True when the inner backend was rebuilt
        (the caller must re-capture its decode graphs)."""
        # no local may hold the inner backend (a bound method, its buckets) past this point: a switch below
        # frees it before building the other one, and a reference left in this frame would keep its slot
        # banks allocated meanwhile: two expert caches at once, an out-of-memory under a budget-sized cache
        # (--gpu-memory-limit, where one cache fills most of the budget)
        if hasattr(self.inner, "observe_decode_step"):  # hybrid tunes its split on the same step times
            self.inner.observe_decode_step(seconds, tokens)
        if self.settled or tokens <= 0:
            return False
        if self._inner_settling(tokens):  # hybrid still searching this bucket's split
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        bucket = bucket_name(tokens, self.decode_cap)
        self._samples.setdefault(bucket, []).append(seconds / tokens)
        if sum(map(len, self._samples.values())) < TRIAL_STEPS:
            return False
        self.trial[self.current] = {b: sorted(v)[len(v) // 2] for b, v in self._samples.items()
                                    if len(v) >= MIN_BUCKET_STEPS}
        self._samples, self._skip = {}, WARMUP_STEPS
        other = OTHER[self.current]
        if other not in self.trial:
            return self._switch(other, "timing the other candidate")
        best = self._verdict()
        self.settled = True
        timings = "; ".join(f"{k}: " + ", ".join(f"T={b} {v * 1e3:.2f}" for b, v in sorted(t.items()))
                            for k, t in self.trial.items())
        log.info("auto verdict: %s, per bucket %s (ms/token %s; the profile predicted %s)", best,
                 self.bucket_verdict or "none timed by both", timings, self.decision.backend)
        if best != self.current:
            return self._switch(best, "verdict")
        self._apply_pins()
        return False

    def _inner_settling(self, tokens: int) -> bool:
        buckets = getattr(self.inner, "buckets", None)
        return buckets is not None and buckets.settling(tokens)

    def _verdict(self) -> str:
        """Per bucket timed by both candidates the faster; hybrid when it wins any (else offload). No
        bucket timed by both (the batch size moved between the trials): the profile's choice stays."""
        off, hyb = self.trial.get(MoEBackend.OFFLOAD.value, {}), self.trial.get(MoEBackend.HYBRID.value, {})
        self.bucket_verdict = {b: (MoEBackend.HYBRID.value if hyb[b] < off[b] else MoEBackend.OFFLOAD.value)
                               for b in sorted(set(off) & set(hyb), key=lambda n: (n == "prefill", len(n), n))}
        if not self.bucket_verdict:
            return self.decision.backend
        return (MoEBackend.HYBRID.value if MoEBackend.HYBRID.value in self.bucket_verdict.values()
                else MoEBackend.OFFLOAD.value)

    def _apply_pins(self) -> None:
        """Hybrid after the verdict: the buckets offload won run the offload path (f = 1)."""
        buckets = getattr(self.inner, "buckets", None)
        if buckets is None:
            return
        for name, winner in self.bucket_verdict.items():
            if name in buckets.by_name and winner == MoEBackend.OFFLOAD.value:
                buckets.pin(name, 1.0)

    def _switch(self, kind: str, why: str) -> bool:
        log.info("auto: switching %s -> %s (%s)", self.current, kind, why)
        previous = self.current
        self._release_inner()
        failure = None
        try:
            self.inner = self._build(kind)
        except torch.OutOfMemoryError as exc:  # the device held less than when the first one was built
            failure = str(exc).splitlines()[0]  # (outside this block: the traceback keeps the partial build)
        if failure is not None:
            self._release_inner()
            log.warning("auto: %s does not fit on the device (%s); settled on %s, which ran before", kind,
                        failure, previous)
            self.inner, kind = self._build(previous), previous
            self.settled = True
        self.current = kind
        if self.settled:
            self._apply_pins()
        return True

    def _decide(self):
        cache_rate = self.num_slots / self.geometry.total_experts
        misses = expected_misses_per_layer(self.ctx.top_k, cache_rate)
        fmt, fallback = profile_format(self.ctx)  # the bank format's entry (fp8_block, ...), else the dtype's
        return auto_backend(gpu_uuid(self.ctx.device), self.geometry.expert_nbytes, misses, self.geometry.num_layers,
                            fmt=fmt, fallback_fmt=fallback)

    def _build(self, kind: str) -> ExpertBackend:
        if kind == MoEBackend.HYBRID.value:
            return HybridBackend(self.ctx, MoEBackend.HYBRID, num_slots=self.num_slots)
        return OffloadBackend(self.ctx, num_slots=self.num_slots)

    @property
    def cuda_graph_safe(self) -> bool:
        """Read by the runner: whether decode steps may be captured (the inner backend's answer)."""
        return getattr(self.inner, "cuda_graph_safe", isinstance(self.inner, OffloadBackend))

    @property
    def same_split(self):
        """The inner backend's ``same_split`` (hybrid), else None: read by the runner's replay check."""
        return getattr(self.inner, "same_split", None)

    def warm(self, hidden: torch.Tensor) -> int:
        """Compile the inner backend's kernels before serving (runner.warm_up)."""
        warm = getattr(self.inner, "warm", None)
        return warm(hidden) if warm is not None else 0

    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] · topk_ids [T, A] int64 · topk_weights [T, A] -> [T, D]."""
        return self.inner.forward(moe_layer, hidden, topk_ids, topk_weights)

    def reload_profile(self) -> dict:
        """Re-read this GPU's profile between two steps (and time the candidates again); says what changed."""
        old = self.current
        self.decision, self.profile_path = self._decide()
        rebuilt = self.decision.backend != old
        if rebuilt:
            self._release_inner()
            self.inner = self._build(self.decision.backend)
        elif isinstance(self.inner, HybridBackend) and self.inner.max_fetch < 0:
            self.inner.reset_split(profile_prior(self.ctx))
        self._start_trial()
        log.info("profile reloaded: %s -> %s%s", old, self.decision.backend, " (backend rebuilt)" if rebuilt else "")
        return {"auto": self._describe(), "rebuilt": rebuilt}

    def _release_inner(self) -> None:
        if hasattr(self.inner, "close"):  # through self.inner: a local bound method would keep it alive
            self.inner.close()
        self.inner = None  # type: ignore[assignment]
        gc.collect()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the old slot banks' VRAM goes back before the new ones are allocated

    def _describe(self) -> dict:
        d = self.decision
        return {"chosen": d.backend, "running": self.current, "fetch_fraction": d.fetch_fraction,
                "t_offload_s": d.t_offload_s, "t_hybrid_s": d.t_hybrid_s, "reason": d.reason,
                "profile": str(self.profile_path) if self.profile_path else None,
                "measured_s_per_token": {k: dict(v) for k, v in self.trial.items()},  # backend -> bucket -> s
                "bucket_verdict": dict(self.bucket_verdict), "settled": self.settled,
                "buckets": self._bucket_modes()}

    def _bucket_modes(self) -> dict:
        """Per bucket what runs now: offload, hybrid (a split) or cpu (every miss on the CPU), and its f."""
        buckets = getattr(self.inner, "buckets", None)
        if buckets is None:  # offload: every bucket fetches every miss
            return {b: {"mode": MoEBackend.OFFLOAD.value, "fetch_fraction": 1.0} for b in self.bucket_verdict}
        return {name: {"mode": s["mode"], "fetch_fraction": s["fetch_fraction"], "pinned": s["pinned"]}
                for name, s in buckets.stats().items()}

    def stats(self) -> dict:
        return {**self.inner.stats(), "auto": self._describe()}


@register_backend(MoEBackend.AUTO)
def _make_auto(ctx: BackendContext) -> AutoBackend:
    return AutoBackend(ctx)

"""`--moe-backend auto`: offload or hybrid, and hybrid's starting fetch fraction, from this GPU's bandwidth
profile (``services.common.profiles.decide``: predicted per-token time of both from the concurrent
bandwidths and c_sync). The profile is the prior, not the verdict: under hybrid the split controller keeps
correcting f while serving. No profile (or no GPU): offload, with a log line saying how to make one.

The profile's verdict is checked online too (the reference's known failure: an offline profile picking
hybrid where it is several times slower, e.g. when per-layer handoffs or eager launches dominate). The
engine reports each decode step's wall time (``observe_decode_step``); after a warm-up the chosen backend
is timed for TRIAL_STEPS steps, then the other one, and the faster per token is kept for good.

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
from services.engine.moe.hybrid import HybridBackend, profile_prior
from services.engine.moe.offload import OffloadBackend, kv_reserve_bytes
from services.engine.moe.sizing import CacheGeometry, decide_cache_size
from services.engine.moe.split import SplitController

log = get_logger("moe.auto")

WARMUP_STEPS = 16  # decode steps ignored after a (re)build: the new cache starts empty
TRIAL_STEPS = 32  # decode steps timed per candidate (median per token)
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
                                           kv_reserve_bytes(ctx)).slots
        self.decision, self.profile_path = self._decide()
        self.inner: ExpertBackend = self._build(self.decision.backend)
        self._start_trial()

    # ---- online verdict ------------------------------------------------------------------------------

    def _start_trial(self) -> None:
        self.current = self.decision.backend
        self.trial: dict[str, float] = {}  # backend -> median seconds per decode token
        self._samples: list[float] = []
        self._skip = WARMUP_STEPS
        self.settled = False

    @property
    def may_rebuild(self) -> bool:
        """Until the verdict the next observe_decode_step may rebuild the inner backend, freeing what a step
        still in flight on the device uses: the engine chains no decode steps (decode overlap) until then."""
        return not self.settled

    def observe_decode_step(self, seconds: float, tokens: int) -> bool:
        """One decode step's wall time for ``tokens`` sequences. True when the inner backend was rebuilt
        (the caller must re-capture its decode graphs)."""
        inner_observe = getattr(self.inner, "observe_decode_step", None)
        if inner_observe is not None:  # hybrid tunes its split on the same step times
            inner_observe(seconds, tokens)
        if self.settled or tokens <= 0:
            return False
        if getattr(self.inner, "settling", False):  # hybrid still searching its split: not its speed yet
            return False
        if self._skip > 0:
            self._skip -= 1
            return False
        self._samples.append(seconds / tokens)
        if len(self._samples) < TRIAL_STEPS:
            return False
        self.trial[self.current] = sorted(self._samples)[len(self._samples) // 2]
        self._samples, self._skip = [], WARMUP_STEPS
        other = OTHER[self.current]
        if other not in self.trial:
            return self._switch(other, "timing the other candidate")
        best = min(self.trial, key=self.trial.get)
        self.settled = True
        timings = ", ".join(f"{k} {v * 1e3:.2f} ms/token" for k, v in self.trial.items())
        log.info("auto verdict: %s (%s; the profile predicted %s)", best, timings, self.decision.backend)
        return self._switch(best, "verdict") if best != self.current else False

    def _switch(self, kind: str, why: str) -> bool:
        log.info("auto: switching %s -> %s (%s)", self.current, kind, why)
        self._release_inner()
        self.inner = self._build(kind)
        self.current = kind
        return True

    def _decide(self):
        cache_rate = self.num_slots / self.geometry.total_experts
        misses = expected_misses_per_layer(self.ctx.top_k, cache_rate)
        return auto_backend(gpu_uuid(self.ctx.device), self.geometry.expert_nbytes, misses, self.geometry.num_layers,
                            fmt=str(self.ctx.dtype).removeprefix("torch."))

    def _build(self, kind: str) -> ExpertBackend:
        if kind == MoEBackend.HYBRID.value:
            return HybridBackend(self.ctx, MoEBackend.HYBRID, num_slots=self.num_slots)
        return OffloadBackend(self.ctx, num_slots=self.num_slots)

    @property
    def cuda_graph_safe(self) -> bool:
        """Read by the runner: whether decode steps may be captured (the inner backend's answer)."""
        return getattr(self.inner, "cuda_graph_safe", isinstance(self.inner, OffloadBackend))

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
            self.inner.controller = SplitController(self.inner.expert_bytes, **profile_prior(self.ctx))
        self._start_trial()
        log.info("profile reloaded: %s -> %s%s", old, self.decision.backend, " (backend rebuilt)" if rebuilt else "")
        return {"auto": self._describe(), "rebuilt": rebuilt}

    def _release_inner(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
        self.inner = None  # type: ignore[assignment]
        gc.collect()
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the old slot banks' VRAM goes back before the new ones are allocated

    def _describe(self) -> dict:
        d = self.decision
        return {"chosen": d.backend, "running": self.current, "fetch_fraction": d.fetch_fraction,
                "t_offload_s": d.t_offload_s, "t_hybrid_s": d.t_hybrid_s, "reason": d.reason,
                "profile": str(self.profile_path) if self.profile_path else None,
                "measured_s_per_token": dict(self.trial), "settled": self.settled}

    def stats(self) -> dict:
        return {**self.inner.stats(), "auto": self._describe()}


@register_backend(MoEBackend.AUTO)
def _make_auto(ctx: BackendContext) -> AutoBackend:
    return AutoBackend(ctx)

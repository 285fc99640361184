"""`--moe-backend auto`: offload or hybrid, and hybrid's starting fetch fraction, from this GPU's bandwidth
profile (``services.common.profiles.decide``: predicted per-token time of both from the concurrent
bandwidths and c_sync). The profile is the prior, not the verdict: under hybrid the split controller keeps
correcting f while serving. No profile (or no GPU): offload, with a log line saying how to make one.

``reload_profile()`` re-reads the profile while serving: same backend -> hybrid's controller restarts from
the new prior; another backend -> the inner backend is rebuilt (the engine then re-captures its decode
graphs, which hold the old backend's buffers)."""

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
        """Re-read this GPU's profile between two steps; says what changed."""
        old = self.decision.backend
        self.decision, self.profile_path = self._decide()
        rebuilt = self.decision.backend != old
        if rebuilt:
            self._release_inner()
            self.inner = self._build(self.decision.backend)
        elif isinstance(self.inner, HybridBackend) and self.inner.max_fetch < 0:
            self.inner.controller = SplitController(self.inner.expert_bytes, **profile_prior(self.ctx))
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
        return {"chosen": d.backend, "fetch_fraction": d.fetch_fraction, "t_offload_s": d.t_offload_s,
                "t_hybrid_s": d.t_hybrid_s, "reason": d.reason,
                "profile": str(self.profile_path) if self.profile_path else None}

    def stats(self) -> dict:
        return {**self.inner.stats(), "auto": self._describe()}


@register_backend(MoEBackend.AUTO)
def _make_auto(ctx: BackendContext) -> AutoBackend:
    return AutoBackend(ctx)

"""What the engine says about itself: its maintenance state (loading, serving, reloading, failed), GET
/health, GET /engine/v1/info, GET /engine/v1/stats and the expert counters exported at scrape time
(GET /metrics). The JSON shapes of info and the backend's counters are reports.py's; this file gathers
them from the engine's parts.

EngineStatus is a part of Engine (engine.py, its base class): it reads the engine's own state, and reads
the device only through ``Engine.call`` (on the model thread, between two steps)."""

from __future__ import annotations

import asyncio
import enum
import time
from typing import Any

from services.engine.reports import flat_backend_stats, vram_stats

THROUGHPUT_WINDOW_S = 10.0
STATS_TIMEOUT_S = 30.0  # a step never takes this long; past it the stats come without device counters
# A call queued on the model thread is served between two steps and turns decode overlap off for that
# step (step_loop._may_chain); an endpoint picker scrapes every 50 ms, so reading the backend's counters
# at each scrape would stop overlap for good while serving. Prometheus scrapes every 15 s: once a second
# loses nothing. An idle engine is read at every scrape (nothing to disturb, and the counters are exact).
BACKEND_REFRESH_S = 1.0


class Maintenance(str, enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    RELOADING = "reloading"
    FAILED = "failed"


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); the API answers 503."""


class EngineStatus:
    """Health, info, stats and the metrics refresh: the reporting side of Engine."""

    @property
    def backend(self):
        """The expert backend of the loaded model (LoadedModel.backend, else found on the model)."""
        if self.loaded is None:
            return None
        backend = getattr(self.loaded, "backend", None)
        if backend is None:
            backend = getattr(self.loaded.model, "backend", None)
        return backend

    def health(self) -> dict:
        if self.maintenance == Maintenance.LOADING:
            return {"status": "loading", "progress": self.progress, "model": self.config.model}
        out = {"status": "ok", "maintenance": self.maintenance.value, "model": self.config.model,
               "backend": self.config.moe_backend.value}
        if self.loaded is not None:
            out["model_id"] = self.loaded.model_id
        if self.error:
            out["error"] = self.error
        return out

    def info(self) -> dict:
        if self._info is None:
            raise EngineNotReadyError(f"engine is {self.maintenance.value}; info is known once the model is loaded")
        return self._info

    async def stats(self) -> dict:
        """GET /engine/v1/stats: throughput over the window, requests, KV use, expert counters, VRAM."""
        now = time.monotonic()
        window = list(self._window)  # one atomic copy: the model thread appends concurrently
        tokens = sum(n for t, n in window if t >= now - THROUGHPUT_WINDOW_S)
        out: dict[str, Any] = {"maintenance": self.maintenance.value, "moe_backend": self.config.moe_backend.value,
                               "model": self.config.model, "uptime_s": time.time() - self.started_at,
                               "throughput_window_s": THROUGHPUT_WINDOW_S,
                               "generation_tokens_per_s": tokens / THROUGHPUT_WINDOW_S, **self._totals}
        if self.scheduler is not None:
            out.update(self.scheduler.stats())
        if self.kv_budget is not None:  # the VRAM split: this pool beside the expert cache's "experts" bytes
            out["kv_cache"] = {"bytes": self.kv_budget.nbytes, "tokens": self.kv_budget.tokens,
                               "block_size": self.kv_budget.block_size, "how": self.kv_budget.how,
                               "max_seq_len": self.config.max_seq_len,
                               "max_prefill_tokens": self.config.max_prefill_tokens}
        if self.runner is not None:
            out.update(self.runner.stats())
        out.update({"experts": {}, "vram": None, "vram_gib": None, **(await self._device_stats())})
        out["expert_cache"] = out["experts"]  # older name (tests/deploy reads it); "experts" is the one to use
        return out

    async def refresh_metrics(self) -> None:
        """At scrape time (GET /metrics): the waiting gauge from the live queues (a request counts from the
        moment it is submitted, not from the end of the step running then: what an endpoint picker's
        TotalQueuedRequests means), and the expert backend's cumulative counters (while serving at most
        every BACKEND_REFRESH_S)."""
        if self.metrics is None:
            return
        self.metrics.observe_waiting(self.waiting_now())
        now = time.monotonic()
        busy = self.scheduler is not None and self.scheduler.has_work()
        if not busy or now - self._backend_refreshed_at >= BACKEND_REFRESH_S:
            self._backend_refreshed_at = now
            experts = await self._device_stats()
            self.metrics.record_backend_stats(experts.get("experts", {}))

    async def _device_stats(self) -> dict:
        """Backend counters and VRAM, read on the model thread between two steps: a CUDA call from
        another thread could land inside a graph capture or race a replay. {} unless serving."""
        if self.maintenance not in (Maintenance.SERVING, Maintenance.RELOADING):
            return {}

        def read() -> dict:
            backend = self.backend
            vram = vram_stats(self.config)
            raw = backend.stats() if backend is not None and hasattr(backend, "stats") else {}
            return {"experts": flat_backend_stats(raw),
                    "vram": vram, "vram_gib": vram["allocated_bytes"] / 2**30 if vram else None}

        try:
            return await asyncio.wait_for(self.call(read), STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineNotReadyError):
            return {}

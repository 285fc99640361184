"""The expert-backend contract and its registry (docs/design.md §2).

A MoE block computes the router and then hands the routed experts to one ``ExpertBackend``:

    out[T, D] = backend.forward(moe_layer, hidden[T, D], topk_ids[T, A], topk_weights[T, A])

Backends register a factory under their ``MoEBackend`` value; the engine picks one by config, never by
string compares spread through the code. Every backend must give the same greedy tokens as
``resident`` (fp32): each (token, expert) route is computed exactly once.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch

from services.engine.config import EngineConfig, MoEBackend
from services.engine.moe.banks import ExpertBanks


class ExpertBackend(Protocol):
    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] (compute device) · topk_ids [T, A] int64 · topk_weights [T, A] -> [T, D]."""
        ...

    def stats(self) -> dict:
        """JSON-able counters for the engine's stats (hits, misses, bytes fetched, ...)."""
        ...


@dataclass
class BackendContext:
    """Everything a backend factory may need."""

    banks: ExpertBanks  # host banks (pinned when CUDA is present)
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    top_k: int  # A
    weight_bytes_on_device: int  # non-expert weights already placed (for --moe-cache-auto)
    # bytes the engine allocates after the backend: the paged KV pool and the prefill workspace (runtime/kv_budget.py)
    kv_reserve_bytes: int = 0
    # per MoE layer but the last, the [E, D] predictor of the next layer's routing (moe/prefetch.py);
    # None: the backend cannot prefetch (--moe-prefetch is then ignored, with a log line)
    next_layer_predictors: list[torch.Tensor] | None = None


BackendFactory = Callable[[BackendContext], ExpertBackend]
BACKENDS: dict[MoEBackend, BackendFactory] = {}


def register_backend(kind: MoEBackend) -> Callable[[BackendFactory], BackendFactory]:
    def wrap(factory: BackendFactory) -> BackendFactory:
        BACKENDS[kind] = factory
        return factory
    return wrap


# Modules whose import registers a backend. A new backend adds its module here.
_BACKEND_MODULES = ("services.engine.moe.resident", "services.engine.moe.offload", "services.engine.moe.hybrid",
                   "services.engine.moe.auto")


def make_backend(ctx: BackendContext) -> ExpertBackend:
    for module in _BACKEND_MODULES:
        importlib.import_module(module)
    kind = ctx.config.moe_backend
    if kind not in BACKENDS:
        available = ", ".join(sorted(k.value for k in BACKENDS))
        raise ValueError(f"--moe-backend {kind.value} is not available in this build (available: {available})")
    return BACKENDS[kind](ctx)

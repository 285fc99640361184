"""How many expert slots the GPU cache gets: ``--moe-cache-size N`` | ``--moe-cache-rate r`` |
``--moe-cache-auto`` (docs/design.md §3). One slot holds one expert of one layer (all its banks).

Legend: L MoE layers · E experts per layer · A experts per token (top-k) · S slots.

- size: S = N.   rate: S = ceil(r * L * E).   none given: auto.
- auto on CUDA: budget = min(free VRAM now, --gpu-memory-limit - weights already on the device);
  S = (budget - KV reserve - headroom) // expert bytes, where the KV reserve is the paged KV pool plus the
  prefill workspace of one --max-prefill-tokens chunk (runtime/kv_budget.py) and the headroom (max(512 MiB,
  5% of the budget)) is for decode activations, CUDA graphs and allocator slack.
- auto on a CPU device (documented fallback): there is no VRAM to fill, the "device" slots are host RAM;
  with --gpu-memory-limit the same formula runs against that budget, without it every expert gets a slot.
- S is capped at L * E (more slots than experts is wasted memory) and must be at least the minimum, A:
  one token's experts in one pass. The offload layer processes a step's unique experts in chunks of
  min(E, S), so any S >= 1 would compute correctly, but below A even a single-request decode would need
  several passes per layer (each a full ensure + copy + compute); refusing it turns a silent 2-8x slowdown
  into an error that names the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from services.common.logging import get_logger
from services.engine.config import EngineConfig

log = get_logger("moe.sizing")

GiB = 1 << 30
HEADROOM_MIN_BYTES = 512 << 20
HEADROOM_FRACTION = 0.05


@dataclass(frozen=True)
class CacheGeometry:
    num_layers: int  # L (MoE layers)
    num_experts: int  # E
    top_k: int  # A
    expert_nbytes: int  # bytes of one expert across all banks

    @property
    def total_experts(self) -> int:
        return self.num_layers * self.num_experts

    @property
    def min_slots(self) -> int:
        """The smallest cache accepted: one token's experts (module docstring)."""
        return min(self.top_k, self.total_experts)


@dataclass(frozen=True)
class CacheDecision:
    slots: int  # S
    nbytes: int  # device bytes of the slot banks
    share: float  # S / (L * E)
    how: str  # which flag decided, with the inputs

    def describe(self) -> str:
        return f"{self.slots} slots = {fmt_bytes(self.nbytes)} = {self.share:.1%} of all experts ({self.how})"


def fmt_bytes(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / (1 << 20):.2f} MiB"


def _auto_slots(config: EngineConfig, geom: CacheGeometry, device: torch.device, weight_bytes: int,
                kv_reserve_bytes: int, free_bytes: int | None) -> tuple[int, str]:
    limit = None if config.gpu_memory_limit is None else int(config.gpu_memory_limit * GiB)
    if device.type == "cuda":
        if free_bytes is None:
            free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = free_bytes if limit is None else min(free_bytes, limit - weight_bytes)
        src = f"free {fmt_bytes(free_bytes)}" + ("" if limit is None else f", limit {fmt_bytes(limit)}")
    elif limit is not None:
        budget, src = limit - weight_bytes, f"CPU device, limit {fmt_bytes(limit)}"
    else:
        return geom.total_experts, "auto on a CPU device without --gpu-memory-limit: every expert"
    headroom = max(HEADROOM_MIN_BYTES, int(HEADROOM_FRACTION * budget)) if device.type == "cuda" else 0
    available = budget - kv_reserve_bytes - headroom
    how = (f"auto: {src}, weights {fmt_bytes(weight_bytes)}, KV reserve {fmt_bytes(kv_reserve_bytes)}, "
           f"headroom {fmt_bytes(headroom)}")
    return max(0, available // geom.expert_nbytes), how


def decide_cache_size(config: EngineConfig, geom: CacheGeometry, device: torch.device, weight_bytes: int = 0,
                      kv_reserve_bytes: int = 0, free_bytes: int | None = None,
                      log_decision: bool = True) -> CacheDecision:
    """The slot count for ``config``'s sizing flag, logged; ValueError below the minimum.

    weight_bytes: non-expert weights already on the device · kv_reserve_bytes: KV cache still to come ·
    free_bytes: free device memory (None = ask CUDA; a parameter so tests can fix it) · log_decision:
    False for the engine's preflight check, which decides the same thing again before loading."""
    if config.moe_cache_size is not None:
        slots, flag = config.moe_cache_size, f"--moe-cache-size {config.moe_cache_size}"
        how = flag
    elif config.moe_cache_rate is not None:
        slots = math.ceil(config.moe_cache_rate * geom.total_experts)
        flag = f"--moe-cache-rate {config.moe_cache_rate}"
        how = f"{flag} x {geom.total_experts} experts"
    else:
        slots, how = _auto_slots(config, geom, device, weight_bytes, kv_reserve_bytes, free_bytes)
        flag = "--moe-cache-auto" + ("" if config.gpu_memory_limit is None else f" --gpu-memory-limit {config.gpu_memory_limit}")
    if slots < geom.min_slots:
        raise ValueError(
            f"{flag}: {slots} expert slots ({fmt_bytes(slots * geom.expert_nbytes)}) is below the minimum of "
            f"{geom.min_slots} slots ({fmt_bytes(geom.min_slots * geom.expert_nbytes)}, one token's top-{geom.top_k} "
            f"experts); give a larger cache ({how})")
    if slots > geom.total_experts:
        how += f"; capped at all {geom.total_experts} experts"
        slots = geom.total_experts
    decision = CacheDecision(slots, slots * geom.expert_nbytes, slots / geom.total_experts, how)
    if log_decision:
        log.info("expert cache: %s", decision.describe())
    return decision

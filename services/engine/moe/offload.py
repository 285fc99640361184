"""The `offload` backend: experts live in (pinned) host banks; a GPU slot cache holds the recently used
ones; misses are fetched over PCIe and every routed expert is computed on the GPU (docs/design.md §2-3).

Legend: T tokens · A experts per token · E experts per layer · S slots · D hidden · C = min(E, S).

Per MoE layer and chunk:  ensure (LRU, rewrite ids to slots) -> copy_missing (fused H2D) -> expert GEMMs
straight from the slot banks (`resident`'s moe_compute: the Triton GEMV or grouped GEMM on CUDA, indexed by slot
instead of expert: no per-step copy of a whole bank). A step whose unique experts exceed the cache (a long
prefill with S < E) runs ceil(min(E, T*A) / C) chunks; each route is computed in exactly one of them.
With ``--moe-prefetch P`` a decode step also copies the next layer's predicted experts while this one
computes (services/engine/moe/prefetch.py).
"""

from __future__ import annotations

import torch

from services.common.logging import get_logger
from services.engine.config import CachePolicy, MoEBackend
from services.engine.moe.backends import BackendContext, register_backend
from services.engine.moe.cache import ExpertCache
from services.engine.moe.peer_cache import make_peer_tier
from services.engine.moe.prefetch import NextLayerPrefetch, read_ahead_possible
from services.engine.moe.resident import GATHER_MAX_ROUTES, moe_compute, moe_decode, quant_kwargs
from services.engine.moe.sizing import CacheGeometry, decide_cache_size

log = get_logger("moe.offload")


class OffloadBackend:
    def __init__(self, ctx: BackendContext, num_slots: int | None = None, use_triton: bool | None = None) -> None:
        banks = ctx.banks
        if not banks.layers:
            raise ValueError("--moe-backend offload: the model has no MoE layers")
        geom = CacheGeometry(len(banks.layers), banks.layers[0].num_experts, ctx.top_k, banks.expert_nbytes())
        if num_slots is None:
            num_slots = decide_cache_size(ctx.config, geom, ctx.device, ctx.weight_bytes_on_device,
                                          ctx.kv_reserve_bytes).slots
        elif num_slots < geom.min_slots:
            raise ValueError(f"offload cache of {num_slots} slots is below the minimum of {geom.min_slots}")
        self.cache = ExpertCache(banks, num_slots, ctx.device, use_triton,
                                 lfu=ctx.config.moe_cache_policy is CachePolicy.LFU,
                                 use_cap=ctx.config.moe_cache_lfu_cap)
        self.cache.peer = make_peer_tier(ctx, self.cache)  # --moe-peer-devices: slots on other GPUs
        self.prefetch = make_prefetch(ctx, self.cache)
        self.act = banks.activation  # gpt-oss: clamped SwiGLU, and bias banks mirrored in the slots too
        slots = self.cache.slot_banks
        self.bias = (slots["gate_up_bias"], slots["down_bias"]) if "gate_up_bias" in slots else None  # [S, 2I], [S, D]
        # per MoE layer, the slots' scales and format (fp8_block / mxfp4 / GGUF): a GGUF file's layers may
        # differ in type (a Q4_K_M file's down: q6_K in some layers), the slots being wide enough for any
        self.layer_scales = [quant_kwargs(layer.format, slots) for layer in banks.layers]
        self.top_k = ctx.top_k
        self._check_batch_invariant(ctx.config)

    def _check_batch_invariant(self, config) -> None:
        """--batch-invariant: a decode step (max_running_requests rows, docs/serving.md) must run as ONE chunk.
        Chunks take the step's experts by rank, so which chunk holds a route, and the order in which a token's
        chunk sums are added, would depend on the other rows' experts. (A prompt, prefilled alone, chunks by
        its own routes only.)"""
        routes = config.max_running_requests * self.top_k
        if getattr(config, "batch_invariant", False) and self.cache.num_chunks(routes) > 1:
            raise ValueError(f"--batch-invariant: a decode step's {routes} routes need {self.cache.num_chunks(routes)} "
                             f"passes through the {self.cache.num_slots}-slot expert cache; give at least "
                             f"{min(self.cache.num_experts, routes)} slots or fewer --max-running-requests")

    def prefetching(self, topk_ids: torch.Tensor) -> NextLayerPrefetch | None:
        """The prefetcher when this step may use it: decode-sized (T*A <= GATHER_MAX_ROUTES) and slot-safe."""
        p = self.prefetch
        return p if p is not None and topk_ids.numel() <= GATHER_MAX_ROUTES and p.fits(topk_ids.shape[0]) else None

    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] · topk_ids [T, A] int64 · topk_weights [T, A] -> [T, D]."""
        gate_up, down = self.cache.slot_banks["gate_up"], self.cache.slot_banks["down"]  # [S, 2I, D], [S, D, I]
        prefetch = self.prefetching(topk_ids)  # decode: one chunk
        out = None
        for chunk in range(self.cache.num_chunks(topk_ids.numel())):
            slot_ids = self.cache.ensure(moe_layer, topk_ids, chunk)  # [T, A], -1 outside the chunk
            self.cache.copy_missing(max_jobs=topk_ids.numel())  # a step has at most T*A misses
            if prefetch is not None:
                prefetch.wait(moe_layer)  # this layer's prefetched experts have landed
                prefetch.issue(moe_layer, hidden)  # the next layer's copy runs while this one computes
            # CUDA: the Triton GEMV / grouped GEMM from the slot banks (graph-capturable); CPU: the grouped loop
            part = moe_compute(hidden, slot_ids, topk_weights, gate_up, down, self.act, self.bias,
                               **self.layer_scales[moe_layer])  # [T, D]
            out = part if out is None else out + part
        return out

    def warm(self, hidden: torch.Tensor) -> int:
        """Compile the expert kernels of every step size on the slot banks before serving (DecodeKernel.warm;
        reads whatever the slots hold, writes nothing)."""
        slots = self.cache.slot_banks
        distinct = {kw.get("fmt"): kw for kw in self.layer_scales}.values()  # a GGUF file's layer formats: each
        return sum(moe_decode.warm(hidden, self.top_k, slots["gate_up"], slots["down"], self.act, self.bias, **kw)
                   for kw in distinct)

    def observe_decode_step(self, seconds: float, tokens: int) -> bool:
        """After each decode step (the engine; hybrid calls it too): the peer tier's placement refresh.
        Never asks for a rebuild."""
        if self.cache.peer is not None and tokens > 0:
            self.cache.peer.observe_step()
        return False

    def stats(self) -> dict:
        prefetch = self.prefetch.stats() if self.prefetch is not None else None
        return {"backend": MoEBackend.OFFLOAD.value, "cache": self.cache.stats(), "prefetch": prefetch}


def make_prefetch(ctx: BackendContext, cache: ExpertCache) -> NextLayerPrefetch | None:
    """The next-layer prefetcher of ``--moe-prefetch P`` (None when off or impossible, with the reason)."""
    per_token = ctx.config.moe_prefetch
    if not read_ahead_possible("--moe-prefetch", per_token, cache.num_layers, ctx.next_layer_predictors):
        return None
    prefetch = NextLayerPrefetch(cache, ctx.next_layer_predictors, per_token, ctx.top_k)
    if not prefetch.fits(1):
        log.warning("--moe-prefetch %d: a cache of %d slots is too small to prefetch safely (needs %d at one "
                    "token); prefetch is off", per_token, cache.num_slots, prefetch.slots_needed(1))
        return None
    log.info("next-layer prefetch: %d experts per token predicted and copied ahead", prefetch.per_token)
    return prefetch


@register_backend(MoEBackend.OFFLOAD)
def _make_offload(ctx: BackendContext) -> OffloadBackend:
    return OffloadBackend(ctx)

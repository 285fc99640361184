"""ExpertCache: the GPU slot pool shared by all MoE layers (docs/design.md §3).

Legend: L MoE layers · E experts per layer · S slots · T tokens · A experts per token · C = min(E, S).

It owns the slot banks (``slot_banks[name]`` is ``[S, *bank shape]``, one per bank of the format, the
same shapes and dtype as the host banks), the tables and counters of ``kernels.ensure_experts_ref.
CacheState``, and the copy plan of ``kernels.gather_copy``. Per layer and chunk a backend calls

    slot_ids = cache.ensure(layer, topk_ids, chunk)   # [T, A] slot of each route in the chunk, else -1
    cache.copy_missing()                               # the chunk's misses host -> slots

and computes straight from ``slot_banks``. Both calls stay on the device (no host round trip) when the
device is CUDA; on CPU devices they run the torch reference and the per-bank copy. Counters accumulate on
the device; ``stats()`` copies them once, when asked.
"""

from __future__ import annotations

import torch

from kernels.ensure_experts_ref import USE_CAP, CacheState, check_use_cap, ensure_experts_reference, num_chunks
from services.engine.moe.banks import ExpertBanks


class ExpertCache:
    """The slot pool. ``use_triton`` defaults to "the device is CUDA"; tests may force the Triton kernels
    on the CPU under TRITON_INTERPRET."""

    def __init__(self, banks: ExpertBanks, num_slots: int, device: torch.device,
                 use_triton: bool | None = None, lfu: bool = False, use_cap: int = USE_CAP) -> None:
        """lfu: evict the least used expert first (--moe-cache-policy lfu; kernels/ensure_experts.py) ·
        use_cap: every layer's use counts halve when one reaches it (--moe-cache-lfu-cap)."""
        # Imported here, not at module level: Triton reads TRITON_INTERPRET when a kernel is defined.
        from kernels.gather_copy import CopyPlan

        check_use_cap(use_cap)
        if not banks.layers:
            raise ValueError("expert cache: the model has no MoE layer banks")
        self.num_layers = len(banks.layers)
        self.num_experts = banks.layers[0].num_experts
        self.format = banks.layers[0].format
        self.device = torch.device(device)
        self.state = CacheState.allocate(self.num_layers, self.num_experts, num_slots, self.device)
        host_layers = [layer.tensors for layer in banks.layers]
        if self.device.type == "cuda":  # the fused copy reads host memory through its UVA address
            for l, layer in enumerate(host_layers):
                for name, t in layer.items():
                    if not t.is_pinned():
                        raise ValueError(f"expert cache: host bank {name!r} of MoE layer {l} is not pinned "
                                         "(pin the banks before building the cache: registry.pin_banks)")
        # zeros, not empty: skipped routes read slot 0 with weight 0, and 0 * NaN garbage would be NaN
        self.slot_banks = {name: torch.zeros((num_slots, *t.shape[1:]), dtype=t.dtype, device=self.device)
                           for name, t in host_layers[0].items()}  # [S, ...] per bank
        self.plan = CopyPlan(host_layers, self.slot_banks)
        # one launch for every bank's copies on CUDA (88.9 % of linear H2D at 8 misses on the H200); the
        # per-bank copies stay the CPU device's path and what `tandem bench cache-copy` compares against
        from kernels.gather_copy import CopyMode

        self.copy_mode = CopyMode.FUSED
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self.lfu, self.use_cap = lfu, use_cap
        self.expert_nbytes = self.plan.expert_nbytes()
        self.peer = None  # the slots on other GPUs (--moe-peer-devices): a PeerTier, set by the backend

    @property
    def num_slots(self) -> int:
        return self.state.num_slots

    def slot_nbytes(self) -> int:
        return self.num_slots * self.expert_nbytes

    def num_chunks(self, num_routes: int) -> int:
        """Calls per layer for ``num_routes`` = T*A routes: ceil(min(E, T*A) / min(E, S)); 1 whenever
        S >= E (every prefill) or the step's routes fit (decode with S >= T*A)."""
        return num_chunks(self.state, num_routes)

    def ensure(self, layer: int, topk_ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """topk_ids [T, A] expert ids of ``layer`` -> slot ids [T, A] int64 (-1: route not in this chunk).
        Records the copy jobs of this chunk; see kernels/ensure_experts.py."""
        out = torch.empty(topk_ids.shape, dtype=torch.int64, device=topk_ids.device)
        if self.use_triton:
            from kernels.ensure_experts import ensure_experts

            return ensure_experts(self.state, layer, topk_ids, out, chunk, lfu=self.lfu, use_cap=self.use_cap)
        return ensure_experts_reference(self.state, layer, topk_ids, out, chunk, lfu=self.lfu, use_cap=self.use_cap)

    def copy_missing(self, max_jobs: int | None = None, state: CacheState | None = None) -> None:
        """Copy the jobs of the last ``ensure`` for every bank (one fused launch on CUDA). ``max_jobs``: a
        bound known from the shapes (T*A) that trims the launch grid · ``state``: a view of this cache's
        tables with its own job list (the next-layer prefetch), instead of the cache's jobs."""
        from kernels.gather_copy import copy_missing

        s = self.state if state is None else state
        if self.peer is not None:  # from a peer GPU's slot where one holds the expert, else from the host
            return self.peer.copy_missing(s, max_jobs, self.use_triton)
        copy_missing(self.plan, s.job_src, s.job_dst, s.job_count, self.copy_mode, max_jobs, self.use_triton)

    def stats(self) -> dict:
        """Counters since start (one device->host copy): totals and per layer, bytes, hit rate."""
        counters = torch.stack([self.state.hits, self.state.misses, self.state.fetched]).cpu()  # [3, L]
        hits, misses, fetched = (row.tolist() for row in counters)
        lookups = sum(hits) + sum(misses)
        peer = self.peer.stats() if self.peer is not None else None
        out = {
            "slots": self.num_slots,
            "slot_bytes": self.slot_nbytes(),
            "share_of_experts": self.num_slots / (self.num_layers * self.num_experts),
            "expert_bytes": self.expert_nbytes,
            "copy_mode": self.copy_mode.value,
            "policy": "lfu" if self.lfu else "lru",
            "lfu_cap": self.use_cap,
            "hits": sum(hits),
            "misses": sum(misses),
            "fetched": sum(fetched),
            "bytes_fetched": sum(fetched) * self.expert_nbytes,
            "hit_rate": sum(hits) / lookups if lookups else 0.0,
            "per_layer": {"hits": hits, "misses": misses, "fetched": fetched},
        }
        if peer is not None:  # fetched = from a peer GPU (peer_fetched) + from the host over PCIe
            host = max(0, out["fetched"] - peer["peer_fetched"])  # prefetched peer copies count in peer_fetched only
            out.update(peer=peer, peer_fetched=peer["peer_fetched"], host_fetched=host,
                       bytes_fetched=host * self.expert_nbytes)
            out["per_layer"]["peer_fetched"] = peer.pop("per_layer_peer_fetched")
        return out

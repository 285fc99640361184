"""Warming the CPU's caches with the next layer's experts (``--moe-cpu-warm W``; cpu and hybrid backends).

Legend: T tokens · A experts per token · W experts per token warmed (<= A) · K = max decode tokens x W ·
E experts per layer · D hidden · L MoE layers.

Why: a hybrid decode layer is bound by the host DRAM that the CPU executor and the PCIe copies share
(docs/results/history.md runs 11-13), yet that DRAM idles while only the GPU works — the add of the CPU's
part, attention, the router and the split of the next layer, ~150 us of a ~600 us layer. The H200 host
has 300 MiB of L3, and the executor computes experts found there at 100-134 GB/s against ~82 from DRAM
(run 14). So the idle time is spent reading the experts the CPU is about to need into its caches.

How, per decode layer l (graph mode, the default on CUDA):
    submit(l)        the job word; the CPU computes layer l's share
    plan(l, x_l)     GPU: layer l+1's routing predicted from this layer's MoE input (the prefetch
                     predictor, moe/prefetch.py), the W likeliest per token that are not cached on the GPU
                     (kernels/prefetch_pick.py) -> ``rows[l+1]`` (device) and the executor's pinned warm
                     table (kernels/cpu_handoff.post_warm: ids, fence, then the job's seq)
    ...              once job l is done the executor's pool touches every cache line of those experts,
                     and stops the moment job l+1's word lands (csrc/executor.cpp ``warm_posted``)
    split(l+1)       kernels/ensure_experts_hybrid.py keeps the warmed misses for the CPU and fetches
                     the others first
The eager CUDA handoff does not warm (it exists for debugging; the flag is ignored there, with a log
line). On the CPU device (tests) the same prediction steers the split and the pool warms synchronously
after each job: there is no GPU time to hide it in, but the code path is the same.
"""

from __future__ import annotations

import torch

from services.engine.moe.cache import ExpertCache
from services.engine.moe.cpu_executor import CpuExecutor
from services.engine.moe.cpu_handoff import GraphHandoff
from services.engine.moe.prefetch import pick_next_layer


class CpuWarm:
    """Predicts layer l+1's CPU experts during layer l and has the executor read them ahead (module docstring)."""

    def __init__(self, cache: ExpertCache, predictors: list[torch.Tensor], per_token: int, top_k: int,
                 max_tokens: int, executor: CpuExecutor, handoff: GraphHandoff | None):
        """predictors: ``next_layer_predictors(model)`` · per_token: W (clamped to A) · max_tokens: the most
        tokens of a decode step · handoff: the graph handoff (warms between jobs), None on the CPU device."""
        if len(predictors) != cache.num_layers - 1:
            raise ValueError(f"cpu warm: {len(predictors)} predictors for {cache.num_layers} MoE layers "
                             f"(need one per layer but the last)")
        self.cache, self.predictors, self.executor, self.handoff = cache, predictors, executor, handoff
        self.per_token = min(per_token, top_k)
        self.top_k = top_k
        self.capacity = max_tokens * self.per_token  # K
        self.rows = torch.full((cache.num_layers, self.capacity), -1, dtype=torch.int64, device=cache.device)  # [L, K]
        self.table = handoff.enable_warm(self.capacity) if handoff is not None else None  # pinned [L, 2 + K]
        self.totals = {"warms": 0, "experts": 0, "bytes": 0}  # the CPU device's synchronous warms

    def row(self, layer: int) -> torch.Tensor:
        """[K] the experts of ``layer`` warmed for its split (-1 = none; all -1 for layer 0)."""
        return self.rows[layer]

    def plan(self, layer: int, hidden: torch.Tensor) -> None:
        """During layer ``layer`` (after its submit): predict layer+1's CPU experts from ``hidden`` [T, D]
        (this layer's MoE input) and post them (module docstring)."""
        target = layer + 1
        if target >= self.cache.num_layers or hidden.shape[0] * self.per_token > self.capacity:
            return
        picked = pick_next_layer(self.predictors, layer, hidden, self.cache.state.slot_of_id, self.top_k,
                                 self.per_token, self.cache.use_triton)  # [T, W]
        if self.table is not None:
            from kernels.cpu_handoff import post_warm

            post_warm(self.handoff.seq, picked, self.rows[target], self.table[target])
            return
        row = self.rows[target]
        row.fill_(-1)
        row[: picked.numel()] = picked.reshape(-1)

    def warm_now(self, layer: int) -> None:
        """The CPU device's stand-in for the graph handoff's warm between jobs: read ``layer``'s planned
        experts now (host tensors, no GPU). Nothing past the last layer."""
        if layer >= self.cache.num_layers:
            return
        ids = [e for e in self.rows[layer].tolist() if e >= 0]
        if not ids:
            return
        lb = self.executor.banks.layers[layer]
        nbytes = self.executor._impl.warm_now(lb.tensors["gate_up"], lb.tensors["down"], ids)
        self.totals["warms"] += 1
        self.totals["experts"] += len(set(ids))
        self.totals["bytes"] += nbytes

    def stats(self) -> dict:
        """Warms run, experts and bytes read ahead, and (graph mode) warms cut short by the next job."""
        if self.handoff is None:
            return {"per_token": self.per_token, **self.totals, "cut_short": 0}
        poll = self.handoff.poll_stats()
        return {"per_token": self.per_token, "warms": poll["warm_jobs"], "experts": poll["warm_experts"],
                "bytes": poll["warm_bytes"], "cut_short": poll["warm_aborted"]}

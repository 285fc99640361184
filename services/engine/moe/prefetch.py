"""Next-layer prefetch for the slot cache (docs/design.md §3): while layer l computes, copy the experts layer
l+1 is predicted to route to, so PCIe also works through the time the GPU spends on attention, routing
and its own experts, in which the offload and hybrid decode paths leave it idle (H200 host: ~150 us of
every ~630 us layer of hybrid, docs/results/history.md run 8).

Legend: T tokens · A experts per token · P experts prefetched per token and layer (--moe-prefetch, <= A) ·
E experts per layer · S slots · D hidden · L MoE layers.

Prediction (pre-gating): layer l+1's router applied to layer l's MoE input. That input is
x_l = r / rms(r) * w_l (r the residual stream after attention l, w_l layer l's post-attention norm);
layer l+1's router sees r' / rms(r') * w_{l+1} with r' = r + moe_l + attn_{l+1}. The branches are small
against the stream (it is why the same experts recur across layers' neighbours), so with r' ~ r the
router input is x_l * (w_{l+1} / w_l): the predictor of layer l is ``W_{l+1} * (w_{l+1} / w_l)`` (router
columns scaled; 0 where w_l = 0, whose component x_l lost), one [T, D] x [D, E] matmul. Of its top-A
(the predicted routing) the P likeliest experts that are not cached are copied (kernels/prefetch_pick.py):
P bounds the PCIe bytes spent ahead, on the likeliest misses. How good the guess is depends on the
model: near-perfect on our synthetic models (their stream changes little from layer to layer), lower on
trained checkpoints; the engine's stats count what was prefetched and the cache's hits show what it saved.

Order per layer (decode-sized calls, T*A <= GATHER_MAX_ROUTES (resident.py); larger ones never prefetch):
    ensure(l), copy_missing(l)   main stream: this layer's own misses first
    wait(l)                      main waits for the prefetch of l that layer l-1 issued
    reserve(l, x_l)              main: predict, then reserve slots (ensure_experts on a view of the cache
                                 with its own job list and counters: every table update stays in the
                                 main stream's order)
    copy_ahead()                 side stream, from this point of the main stream: copy the reserved experts
                                 (offload: at once; hybrid: after the CPU's part of l is in, see below)
    experts of l, attention l+1, router l+1, ensure(l+1) ... run while the side stream copies; the
    predicted experts that were right are hits of ensure(l+1).
In hybrid the CPU executor and the PCIe copies read the same host DRAM, which the CPU alone nearly
saturates, so hybrid starts the copy when the CPU's part of layer l is in, aiming at the time the GPU
alone works (attention, routing, ~150 us a layer). On the H200 host neither placement gains (runs 11-12
of docs/results/history.md: the copy spills into the next layer's CPU work, and DRAM, not PCIe, is what hybrid
is short of); offload gains 1-5 % at P = 1-2. Hence off by default.
Slots are safe: the reserve takes LRU victims, and with S >= 2*T*A + T*P (``fits``) there are always
older slots than the T*A in use by layer l and the T*P just reserved, so neither stream writes a slot the
other reads. Smaller caches (tests with a handful of slots) run without prefetch. Under CUDA graphs the
side stream is forked and joined inside the capture (event record / wait), so replays keep the overlap.
"""

from __future__ import annotations

import dataclasses

import torch

from services.common.logging import get_logger
from services.engine.moe.cache import ExpertCache
from services.engine.moe.layer import MoEBlock


log = get_logger("moe.prefetch")


def read_ahead_possible(flag: str, per_token: int, num_layers: int, predictors: list[torch.Tensor] | None) -> bool:
    """Whether a next-layer read-ahead (``--moe-prefetch``) asked for ``per_token``
    experts can run: asked for, a next layer to read for, and the model's routers to predict it with
    (warns when they are missing)."""
    if per_token <= 0 or num_layers < 2:
        return False
    if predictors is None:
        log.warning("%s %d: this backend was built without the model's routers; it is off", flag, per_token)
        return False
    return True


def next_layer_predictors(model) -> list[torch.Tensor]:
    """Per MoE layer l < L-1 the [E, D] predictor of layer l+1's routing from layer l's MoE input (module
    docstring), in the router's dtype and device. ``model`` is a MoECausalLM."""
    moe_layers = [layer for layer in model.model.layers if isinstance(layer.ffn, MoEBlock)]
    blocks = [layer.ffn for layer in moe_layers]
    norms = [layer.post_attention_layernorm.weight for layer in moe_layers]
    out = []
    with torch.no_grad():
        for l in range(len(blocks) - 1):
            w_here, w_next = norms[l].float(), norms[l + 1].float()
            ratio = torch.where(w_here != 0, w_next / torch.where(w_here != 0, w_here, 1.0), 0.0)  # [D]
            router = blocks[l + 1].router_linear.weight  # [E, D]
            out.append((router.float() * ratio).to(router.dtype).contiguous())
    return out


def pick_next_layer(predictors: list[torch.Tensor], layer: int, hidden: torch.Tensor, slot_of_id: torch.Tensor,
                    top_k: int, per_token: int, use_triton: bool) -> torch.Tensor:
    """Layer+1's routing predicted from ``hidden`` [T, D] (layer's MoE input): per token the ``per_token``
    likeliest of its predicted top-k that ``slot_of_id`` does not cache -> [T, per_token] ids, -1 = none.
    The prefetch copies them to GPU slots."""
    if use_triton:
        from kernels.prefetch_pick import prefetch_pick as pick
    else:
        from kernels.prefetch_pick import prefetch_pick_reference as pick
    logits = torch.nn.functional.linear(hidden, predictors[layer])  # [T, E]
    return pick(logits, slot_of_id, layer + 1, top_k, per_token)


class NextLayerPrefetch:
    """Predicts, reserves and copies layer l+1's experts while layer l runs (module docstring)."""

    def __init__(self, cache: ExpertCache, predictors: list[torch.Tensor], per_token: int, top_k: int):
        """predictors: ``next_layer_predictors(model)`` · per_token: P, the most experts copied ahead per
        token and layer (clamped to A: only the predicted top-A are candidates) · top_k: A."""
        if len(predictors) != cache.num_layers - 1:
            raise ValueError(f"prefetch: {len(predictors)} predictors for {cache.num_layers} MoE layers "
                             f"(need one per layer but the last)")
        self.cache = cache
        self.predictors = predictors
        self.per_token = min(per_token, top_k)
        self.top_k = top_k
        s = cache.state
        i32 = dict(dtype=torch.int32, device=s.clock.device)
        i64 = dict(dtype=torch.int64, device=s.clock.device)
        L, C = cache.num_layers, s.chunk_capacity
        # the cache's tables and clock, its own jobs (the side stream reads them while the main stream's
        # ensure writes the cache's) and counters (fetched: experts copied ahead)
        self.state = dataclasses.replace(s, job_src=torch.zeros(C, **i32), job_dst=torch.zeros(C, **i32),
                                         job_count=torch.zeros(1, **i32), hits=torch.zeros(L, **i64),
                                         misses=torch.zeros(L, **i64), fetched=torch.zeros(L, **i64))
        self.side = torch.cuda.Stream(cache.device) if cache.device.type == "cuda" else None
        self._events: dict[int, torch.cuda.Event] = {}  # per target layer, made once and re-recorded
        self._pending: set[int] = set()  # target layers with a copy in flight (the main stream must wait)
        self._reserved: tuple[int, int] | None = None  # (target layer, job bound) of a reserve not yet copied

    def slots_needed(self, num_tokens: int) -> int:
        """The smallest cache a step of ``num_tokens`` tokens may prefetch with (slot safety, module docstring)."""
        return num_tokens * (2 * self.top_k + self.per_token)

    def fits(self, num_tokens: int) -> bool:
        return self.cache.num_slots >= self.slots_needed(num_tokens)

    def wait(self, layer: int) -> None:
        """Make the main stream wait for the copy of ``layer``'s prefetched experts (issued at layer-1)."""
        if layer == 0:  # a new step: forget anything a failed step left behind (never waited across steps)
            self._pending.clear()
            self._reserved = None
        if layer in self._pending:
            self._pending.discard(layer)
            torch.cuda.current_stream(self.cache.device).wait_event(self._events[layer])

    def issue(self, layer: int, hidden: torch.Tensor) -> None:
        """``reserve`` then ``copy_ahead`` at once (offload: PCIe is idle from here to the next layer's copy)."""
        self.reserve(layer, hidden)
        self.copy_ahead()

    def reserve(self, layer: int, hidden: torch.Tensor) -> None:
        """Predict layer+1's experts from ``hidden`` [T, D] (layer's MoE input) and reserve slots for the P
        likeliest that are not cached (main stream); ``copy_ahead`` starts their copy."""
        target = layer + 1
        if target >= self.cache.num_layers or not self.fits(hidden.shape[0]):
            return
        cache, state = self.cache, self.state
        if cache.use_triton:
            from kernels.ensure_experts import ensure_experts as ensure
        else:
            from kernels.ensure_experts_ref import ensure_experts_reference as ensure
        picked = pick_next_layer(self.predictors, layer, hidden, state.slot_of_id, self.top_k, self.per_token,
                                 cache.use_triton)  # [T, P], -1 = none
        # a reservation, not a routing: no use counted (config.py keeps --moe-cache-policy lfu away from here)
        ensure(state, target, picked, torch.empty(picked.shape, dtype=torch.int32, device=picked.device),
               count_uses=False)
        self._reserved = (target, picked.numel())

    def copy_ahead(self) -> None:
        """Copy what the last ``reserve`` took: on the side stream from this point of the main stream (CUDA),
        inline elsewhere. Where a backend calls it decides when PCIe works on it: hybrid calls it once the
        CPU's part is in, so the copy takes the host DRAM while the CPU is idle (the two share it)."""
        if self._reserved is None:
            return
        (target, max_jobs), self._reserved = self._reserved, None
        cache = self.cache
        if self.side is None:
            cache.copy_missing(max_jobs=max_jobs, state=self.state)
            return
        self.side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(self.side):
            cache.copy_missing(max_jobs=max_jobs, state=self.state)
        event = self._events.get(target)
        if event is None:
            event = self._events[target] = torch.cuda.Event()
        event.record(self.side)
        self._pending.add(target)

    def stats(self) -> dict:
        fetched = int(self.state.fetched.sum())  # one device->host copy, when asked
        return {"per_token": self.per_token, "prefetched": fetched, "bytes_prefetched": fetched * self.cache.expert_nbytes}

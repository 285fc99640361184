"""The `cpu` and `hybrid` backends (docs/design.md §2): hits on the GPU slots, misses split between PCIe fetch
and the CPU executor, which reads the host banks in place. `cpu` is hybrid with every miss on the CPU.

Legend: T tokens · A experts per token · E experts per layer · S slots · D hidden · L MoE layers.

Data path per MoE layer of a step of T <= SPLIT_MAX_TOKENS tokens (decode at any batch, short prompt
chunks; each (token, expert) route computed exactly once):
    split_misses           -> gpu_ids, cpu_ids [T, A] (CPU, else -1), from the fraction of the step's
                              bucket (split_buckets.py; kernels/ensure_experts_hybrid.py)
    CPU submit             -> hidden, cpu_ids, weights to pinned buffers on the stream; workers start
                              when the stream's flag lands (the host never waits on the GPU here)
    ensure_gpu_routes      -> slot_ids [T, A] (hit / fetched, else -1): after the submit, so the CPU,
                              the long side of most layers, does not wait for the slot assignment
    copy_missing           -> the F fetched experts host -> slots, meanwhile
    prefetch (optional)    -> wait for this layer's predicted experts, reserve slots for the next layer's;
                              their copy starts after the sync below (--moe-prefetch, moe/prefetch.py)
    GPU expert GEMM        -> slot routes only, through moe_compute (resident.py: the kernel for T)
    sync                   -> wait for the CPU, copy its partial up, add
The CPU executor reads each of its experts once for all the expert's tokens (routes grouped by expert).
Steps above SPLIT_MAX_TOKENS tokens (long prompt chunks) take the offload path: every miss fetched
(hybrid_split.py: which steps split, the buckets' cost models, c_sync).

The split f is per bucket of tokens per step (1, 2, 4, ... up to the decode cap, then "prefill";
services/engine/moe/split_buckets.py) and comes from services/engine/moe/split.py in two stages. The
bucket's cost model (SplitController) gets per step the copy time of the fetched experts, the CPU
compute time and c_sync, and moves f so both sides finish together; at f = 1 (CPU cannot help) layers
run as plain offload (eager: no CPU submit at all; graph mode: an empty CPU job). After
TUNE_AFTER_STEPS steps of the bucket its tuner (SplitTuner) takes over: it times a grid of f (0 = every
miss on the CPU ... 1 = offload) and the model's f on the bucket's time per token and searches around
the fastest. Both paths share the host DRAM, so the rates the model equalises move with f (H200 host:
docs/results/history.md runs 8-10). What each step feeds them (observe_decode_step, and in graph mode
the totals read between steps): hybrid_measure.py.
`--moe-hybrid-max-fetch N >= 0` fixes the split instead: fetch at most N misses per layer.

Two handoffs on CUDA:
- graph mode, what the engine runs (GraphHandoff): the stream writes a pinned job word, executor worker 0 runs the
  job, a kernel waits for the done word; capturable, so the runner replays decode as a CUDA graph, and
  what the split needs (executor totals, the kernels' timings and cache counters) is mirrored to pinned
  memory and read between steps;
- eager (DeviceHandoff, ``graph_mode=False``: the tests and the profiler's c_sync): one C++ call submits,
  enqueuing the input copies and a ready flag through the CUDA driver API, one call waits and enqueues
  the upload; decode then runs without
  graphs, launch-bound (38 ms/token on the 24-layer benchmark model, run 5). The eager layer skips the
  GPU-weight masking (CPU routes have slot -1, which the GPU kernels skip) and sums in place.
c_sync on the H200 host (benchmarks/bench_cpu_executor.py, run 5): graph 22.7 us/layer, eager 40.8 us.
"""

from __future__ import annotations

import time

import torch

from services.common.logging import get_logger
from services.engine.config import MoEBackend
from services.engine.moe.backends import BackendContext, register_backend
from services.engine.moe.cpu_executor import CpuExecutor, default_num_threads
from services.engine.moe.cpu_handoff import DeviceHandoff, GraphHandoff
from services.engine.moe.hybrid_measure import HybridMeasurement
from services.engine.moe.hybrid_split import SPLIT_MAX_DECODE, HybridSplitControl, profile_prior, split_max_tokens
from services.engine.moe.offload import OffloadBackend
from services.engine.moe.resident import moe_compute
from services.engine.moe.split import Q16
from services.engine.moe.split_buckets import SplitBuckets

log = get_logger("moe.hybrid")


class HybridBackend(HybridSplitControl, HybridMeasurement):
    """`hybrid` (mode HYBRID) and `cpu` (mode CPU: no fetch during decode). This file: construction and
    the per-layer data path; the split's cost models in hybrid_split.py, what feeds them in hybrid_measure.py."""

    def __init__(self, ctx: BackendContext, mode: MoEBackend = MoEBackend.HYBRID, num_slots: int | None = None,
                 use_triton: bool | None = None, num_threads: int | None = None, count_routes: bool = False,
                 graph_mode: bool = True):
        """num_slots / use_triton: as OffloadBackend · num_threads: CPU workers (default one per physical
        core, one core left to the thread driving the GPU) · count_routes: count GPU and CPU routes on
        the host (a sync per layer; tests) · graph_mode: CUDA only, the capturable handoff (False: the eager one, for tests and the
        handoff benchmark)."""
        if mode not in (MoEBackend.HYBRID, MoEBackend.CPU):
            raise ValueError(f"hybrid backend: mode must be hybrid or cpu, got {mode}")
        self.mode = mode
        self.offload = OffloadBackend(ctx, num_slots, use_triton)  # cache sizing, slots, prefill path
        self.cache = self.offload.cache
        self.expert_math = (self.offload.act, self.offload.bias)  # gpt-oss: clamped SwiGLU, slot bias banks
        if mode is MoEBackend.CPU and self.offload.prefetch is not None:  # cpu fetches nothing while decoding
            log.info("--moe-prefetch is ignored by the cpu backend (every miss is computed on the CPU)")
            self.offload.prefetch = None
        self.device, self.dtype = ctx.device, ctx.dtype
        self.num_layers = len(ctx.banks.layers)
        self.expert_bytes = ctx.banks.expert_nbytes()
        if num_threads is None:
            num_threads = ctx.config.moe_cpu_threads or default_num_threads(leave_driver_core=ctx.device.type == "cuda")
        # driving a GPU, the engine's own threads stay off the workers' cores (CpuExecutor confine_others):
        # a worker that loses its core stalls its share of every layer (part of decode overlap's +20 %)
        self.executor = CpuExecutor(ctx.banks, num_threads=num_threads, confine_others=ctx.device.type == "cuda")
        self.graph_mode = bool(graph_mode) and ctx.device.type == "cuda"
        self.cuda_graph_safe = self.graph_mode  # read by the runner: capture decode graphs or run eagerly
        cap = ctx.config.moe_hybrid_max_fetch
        if mode is MoEBackend.CPU:  # fixed: every miss on the CPU; rates still measured for stats
            self.max_fetch, prior = 0, {"prior_fraction": 0.0, "gain": 0.0, "probe_every": 0}
        elif cap >= 0:  # fixed cap: fetch min(M, cap), the rest on the CPU
            self.max_fetch, prior = cap, {"prior_fraction": 1.0, "gain": 0.0, "probe_every": 0}
        else:
            self.max_fetch, prior = -1, profile_prior(ctx)
            prior.setdefault("prior_fraction", getattr(ctx, "fetch_fraction", None))
        self._prior = prior
        # one split per bucket of tokens per step (split_buckets.py); graph mode: the fractions live in
        # pinned host memory (the split kernel reads its bucket's through UVA), so a plain store between
        # two replays changes them, and no CUDA call can land inside a capture
        self._tunable = mode is MoEBackend.HYBRID and self.max_fetch < 0
        self.buckets = SplitBuckets(self._make_controller, min(ctx.config.max_running_requests, SPLIT_MAX_DECODE),
                                    split_max_tokens(self._tunable, ctx.config.max_running_requests),
                                    self._tunable, self.graph_mode, ctx.device)
        self.handoff = None
        if ctx.device.type == "cuda":
            D = ctx.banks.layers[0].tensors["down"].shape[1]  # [E, D, I]
            kind = GraphHandoff if self.graph_mode else DeviceHandoff
            self.handoff = kind(self.executor, ctx.device, self.buckets.max_tokens, D, ctx.top_k, ctx.dtype)
        self.count_routes = count_routes
        self.routes = {"gpu": 0, "cpu": 0}
        # eager mode's CPU work (graph mode: the poller's poll_stats); cpu_compute_s feeds bench_hybrid_split's rate
        self.totals = {"cpu_jobs": 0, "cpu_experts": 0, "cpu_routes": 0, "cpu_compute_s": 0.0, "split_steps": 0}
        self._step: dict | None = None
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self._graph_prev: tuple[dict, list[int]] | None = None
        self._calibrate_c_sync()

    # ---- the per-layer data path -------------------------------------------------------------------

    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] · topk_ids [T, A] int64 · topk_weights [T, A] -> [T, D]."""
        if self.graph_mode:  # a captured graph has one fixed structure: always the split path
            return self._forward_graph(moe_layer, hidden, topk_ids, topk_weights)
        if moe_layer == 0 or self._step is None:
            self._begin_step(topk_ids.shape[0])
        step = self._step
        bucket = step["bucket"]
        split = bucket is not None and not (step["q16"] == Q16 and self.max_fetch < 0)
        if not split:  # a long prompt chunk, or the bucket's split backed off to plain offload
            if bucket is not None:
                step["offload_layers"] += 1  # a backed-off step still counts for probing
            if self.count_routes:
                self.routes["gpu"] += int((topk_ids >= 0).sum())
            return self.offload.forward(moe_layer, hidden, topk_ids, topk_weights)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"--moe-backend {self.mode.value}: the CPU handoff cannot be captured in a CUDA "
                               "graph; run decode eagerly with this backend")
        gpu_ids, cpu_ids = self._split(moe_layer, topk_ids, bucket)  # [T, A] each
        if self.handoff is not None:
            self.handoff.submit(moe_layer, hidden, cpu_ids, topk_weights)
        else:
            self.executor.submit(hidden, cpu_ids, topk_weights, moe_layer)
        slot_ids = self._ensure_gpu(moe_layer, gpu_ids)  # [T, A]
        marks = step["fetch_marks"]
        t0 = self._mark(moe_layer, 0)
        self.cache.copy_missing(max_jobs=topk_ids.numel())
        marks.append((t0, self._mark(moe_layer, 1)))
        prefetch = self._prefetch_reserve(moe_layer, hidden, topk_ids)
        # CPU routes have slot -1, which the GPU kernels skip (no weight masking needed: 3 launches saved)
        slots = self.cache.slot_banks  # gate_up, down (+ the format's scale banks: offload.layer_scales)
        part = moe_compute(hidden, slot_ids, topk_weights, slots["gate_up"], slots["down"], *self.expert_math,
                           **self.offload.layer_scales[moe_layer])  # [T, D]
        cpu_part = self.handoff.sync() if hidden.is_cuda else self.executor.wait()  # [T, D] fp32
        ex = self.executor
        step["cpu_s"] += ex.last_compute_seconds
        step["cpu_experts"] += ex.last_experts
        step["cpu_layers"] += 1 if ex.last_experts else 0
        self.totals["cpu_jobs"] += 1
        self.totals["cpu_experts"] += ex.last_experts
        self.totals["cpu_routes"] += ex.last_routes
        self.totals["cpu_compute_s"] += ex.last_compute_seconds
        if self.count_routes:
            self.routes["gpu"] += int((slot_ids >= 0).sum())
            self.routes["cpu"] += ex.last_routes
        # one launch: the sum in fp32, rounded once into part's dtype (== (part.float() + cpu_part).to(dtype))
        out = torch.add(part, cpu_part, out=part) if part.dtype == hidden.dtype else (part.float() + cpu_part).to(hidden.dtype)
        if prefetch is not None:
            prefetch.copy_ahead()  # the CPU's part is in: the copy takes the host DRAM while the CPU is idle
        return out

    def _forward_graph(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        """The capturable path: no host sync, no Python decision that depends on data or time (the bucket
        depends on T alone, fixed per captured graph)."""
        bucket = self.buckets.index(topk_ids.shape[0])
        if bucket is None:  # a long prompt chunk (never captured: eager, like its count)
            if self.count_routes:
                self.routes["gpu"] += int((topk_ids >= 0).sum())
            return self.offload.forward(layer, hidden, topk_ids, topk_weights)
        gpu_ids, cpu_ids = self._split(layer, topk_ids, bucket)  # [T, A] each
        self.handoff.submit(layer, hidden, cpu_ids, topk_weights)  # the CPU starts while the slots are assigned
        slot_ids = self._ensure_gpu(layer, gpu_ids)  # [T, A]
        self.cache.copy_missing(max_jobs=topk_ids.numel())
        prefetch = self._prefetch_reserve(layer, hidden, topk_ids)
        slots = self.cache.slot_banks  # CPU routes: slot -1, skipped
        state = self.cache.state
        part = moe_compute(hidden, slot_ids, topk_weights, slots["gate_up"], slots["down"], *self.expert_math,
                           **self.offload.layer_scales[layer])  # [T, D]
        out = self.handoff.sync_add(layer, part, cache_counters=(state.misses, state.fetched))
        if prefetch is not None:
            prefetch.copy_ahead()  # the CPU's part is in: the copy takes the host DRAM while the CPU is idle
        if self.count_routes and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)
            self.routes["gpu"] += int((slot_ids >= 0).sum())
            self.routes["cpu"] = self.handoff.poll_stats()["routes"] - self._routes_at_start
        return out

    def warm(self, hidden: torch.Tensor) -> int:
        """Compile before serving (runner.warm_up): the GPU expert kernels on the slot banks (offload's warm)
        and, in graph mode, the split and handoff kernels at every size class of T up to max_tokens (their
        block sizes follow T), through a layer call whose routes are all skipped (-1): no expert present,
        an empty CPU job, the cache untouched. Returns the calls made."""
        calls = self.offload.warm(hidden)
        if not self.graph_mode:  # eager mode times its steps per call: a warm call would count as one
            return calls
        D, A = hidden.shape[1], self.handoff.A
        sizes = sorted({1, 3} | {1 << i for i in range(self.buckets.max_tokens.bit_length())} | {self.buckets.max_tokens})
        for T in (t for t in sizes if t <= self.buckets.max_tokens):
            x = hidden[:1].expand(T, D).contiguous()
            ids = torch.full((T, A), -1, dtype=torch.int64, device=hidden.device)
            self._forward_graph(0, x, ids, torch.zeros(T, A, device=hidden.device))
            calls += 1
        torch.cuda.synchronize(self.device)
        return calls

    def _prefetch_reserve(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor):
        """After this layer's own copy (--moe-prefetch): wait for its prefetched experts, reserve the next
        layer's. Returns the prefetcher whose ``copy_ahead`` the caller starts once the CPU's part is in."""
        prefetch = self.offload.prefetching(topk_ids)
        if prefetch is not None:
            prefetch.wait(layer)
            prefetch.reserve(layer, hidden)
        return prefetch

    def close(self) -> None:
        """Stop the CPU side (graph-mode poller, workers)."""
        if self.graph_mode:
            self.handoff.close()
        self.executor.close()

    def _split(self, layer: int, topk_ids: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's misses between fetch and CPU -> (gpu_ids, cpu_ids) [T, A] (kernels/ensure_experts_hybrid.py)."""
        if self.cache.use_triton:
            from kernels.ensure_experts_hybrid import split_misses as split
        else:
            from kernels.ensure_experts_hybrid import split_misses_reference as split
        peer = self.cache.peer  # --moe-peer-devices: the misses a peer GPU holds are fetched first
        return split(self.cache.state, layer, topk_ids, self.buckets.f_view(bucket), self.max_fetch, lfu=self.cache.lfu,
                     use_cap=self.cache.use_cap, prefer=peer.peer_slot_of_id if peer is not None else None)

    def _ensure_gpu(self, layer: int, gpu_ids: torch.Tensor) -> torch.Tensor:
        """Slots for the split's GPU routes (hits kept, the fetched misses take victims) -> slot_ids [T, A]."""
        from kernels.ensure_experts_hybrid import ensure_gpu_routes

        return ensure_gpu_routes(self.cache.state, layer, gpu_ids, lfu=self.cache.lfu, use_cap=self.cache.use_cap,
                                 use_kernel=self.cache.use_triton)

    def _mark(self, layer: int, which: int):
        """A fetch-time mark: a CUDA event on the stream (read when the step is closed, no sync) or a host
        clock. Events are made once per (layer, start|end) and re-recorded: creating one costs a driver call."""
        if self.device.type == "cuda":
            ev = self._events.get((layer, which))
            if ev is None:
                ev = self._events[(layer, which)] = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()


@register_backend(MoEBackend.HYBRID)
def _make_hybrid(ctx: BackendContext) -> HybridBackend:
    return HybridBackend(ctx, MoEBackend.HYBRID)


@register_backend(MoEBackend.CPU)
def _make_cpu(ctx: BackendContext) -> HybridBackend:
    return HybridBackend(ctx, MoEBackend.CPU)

"""What hybrid measures after each step (moe/hybrid.py): the step's fetch and CPU times and the cache's
miss/fetch counters for its bucket's cost model, the step's wall time for the bucket's tuner, and the
backend's stats. Eager mode times a step as it runs (fetch marks, the executor's last job) and closes it
at the next step's first layer; graph mode runs no Python per layer, so the totals come from pinned memory
between steps (the executor's poll_stats, the kernels' stamps and counters).

HybridMeasurement is a part of HybridBackend (its base class) and reads the backend's own state."""

from __future__ import annotations

import statistics

import torch

from services.common.logging import get_logger
from services.engine.moe.split import Q16

log = get_logger("moe.hybrid")


class HybridMeasurement:
    """Per-step observation and stats: the measuring side of HybridBackend."""

    def observe_decode_step(self, seconds: float, tokens: int) -> bool:
        """Called by the engine after each decode step of ``tokens`` sequences (model thread, between
        steps). Graph mode feeds the bucket's cost model here (replays run no Python per layer); both
        modes then let the bucket's tuner move its f on the time per token. Host memory only in graph
        mode (the executor's totals, the pinned stamps and counters). Never asks for a rebuild."""
        self.offload.observe_decode_step(seconds, tokens)  # the peer tier's placement refresh
        self._observe_step(seconds, tokens)
        return False

    def observe_prefill_step(self, seconds: float, tokens: int) -> None:
        """As observe_decode_step for a step with prompt tokens (``tokens``: all the step's tokens): the
        prefill bucket's tuner decides whether its chunks split or take the offload path."""
        self._observe_step(seconds, tokens)

    def _observe_step(self, seconds: float, tokens: int) -> None:
        bucket = self.buckets.index(tokens) if tokens > 0 else None
        if bucket is None:  # nothing ran or a long prompt chunk (offload path, not tuned)
            self._graph_prev = None  # graph mode: the next step starts a new baseline (offload ran no jobs)
            return
        if self.graph_mode:
            self._observe_graph_step(bucket)
        line = self.buckets.observe(bucket, seconds, tokens)
        if line:
            log.info("hybrid: %s", line)

    def _observe_graph_step(self, bucket: int) -> None:
        """Graph mode: one step's totals for its bucket's cost model: CPU jobs from the executor, the
        cache's miss/fetch counters and the GPU side's per-layer time (%globaltimer stamps), all mirrored
        to pinned memory by the kernels (a CUDA call here could land inside a capture)."""
        poll = self.handoff.poll_stats()
        counts = self.handoff.counters.sum(dim=0).tolist()  # [2]: misses, fetched (cumulative)
        if poll["error"]:
            log.error("cpu executor (graph mode): %s", poll["error"])
        prev, self._graph_prev = self._graph_prev, (poll, counts)
        if prev is None or poll["jobs"] <= prev[0]["jobs"]:
            return
        prev_poll, prev_counts = prev
        jobs = poll["jobs"] - prev_poll["jobs"]
        gpu_side = [enter - sig for sig, enter, _ in self.handoff.stamps.tolist() if sig and enter > sig]
        self.buckets.states[bucket].controller.observe(
            layers=jobs, misses=counts[0] - prev_counts[0], fetched=counts[1] - prev_counts[1],
            fetch_s=jobs * statistics.fmean(gpu_side) * 1e-9 if gpu_side else 0.0,
            cpu_experts=poll["experts"] - prev_poll["experts"], cpu_s=poll["compute_s"] - prev_poll["compute_s"])
        self.totals["split_steps"] += 1

    # ---- eager mode: a step is timed as it runs and closed at the next step's first layer ------------

    def _counters(self) -> torch.Tensor:
        s = self.cache.state
        return torch.stack([s.misses.sum(), s.fetched.sum()])  # [2] int64 on the device

    def _begin_step(self, tokens: int) -> None:
        """Close the previous step (feed its bucket's controller) and open a new one of ``tokens`` tokens."""
        prev = self._step
        if prev is not None and (prev["fetch_marks"] or prev["offload_layers"]):
            self._finish(prev)
        bucket = self.buckets.index(tokens)
        q16 = self.buckets.write(bucket) if bucket is not None else Q16
        self._step = {"bucket": bucket, "q16": q16, "fetch_marks": [], "offload_layers": 0, "cpu_s": 0.0,
                      "cpu_experts": 0, "cpu_layers": 0,
                      "counters": self._counters()}  # device snapshot, read when the step is closed

    def _finish(self, step: dict) -> None:
        marks = step["fetch_marks"]
        if not marks:  # backed off: only misses are known (offload layers are not timed)
            fetch_s = 0.0
        elif self.device.type == "cuda":
            marks[-1][1].synchronize()  # the step is long done by now (sampling synced); cheap
            fetch_s = sum(a.elapsed_time(b) for a, b in marks) * 1e-3
        else:
            fetch_s = sum(b - a for a, b in marks)
        misses, fetched = (self._counters() - step["counters"]).tolist()
        self.buckets.states[step["bucket"]].controller.observe(
            layers=len(marks) + step["offload_layers"], misses=misses, fetched=fetched, fetch_s=fetch_s,
            cpu_experts=step["cpu_experts"], cpu_s=step["cpu_s"])
        self.totals["split_steps"] += 1

    def stats(self) -> dict:
        cache = self.cache.stats()
        cache["cpu_computed"] = cache["misses"] - cache["fetched"]
        last = self.buckets.states[self.buckets.last]  # the headline: the last observed step's bucket
        split = last.controller.stats()
        if self.graph_mode:  # the poller counts the jobs; Python never sees them
            poll = self.handoff.poll_stats()
            self.totals.update(cpu_jobs=poll["jobs"], cpu_experts=poll["experts"], cpu_routes=poll["routes"])
        return {
            "backend": self.mode.value,
            "cache": cache,
            "split": {**split, "max_fetch": self.max_fetch, "f_q16": last.q16, "graph_mode": self.graph_mode,
                      "bucket": last.name, "tuner": last.tuner.stats() if last.tuner is not None else None,
                      "c_sync_calibrated_seconds": self.c_sync_calibrated, "steps": self.totals["split_steps"],
                      "max_tokens": self.buckets.max_tokens},
            "buckets": self.buckets.stats(),  # per bucket of tokens per step: mode, f, controller, tuner
            "prefetch": self.offload.prefetch.stats() if self.offload.prefetch is not None else None,
            "cpu_executor": {"isa": self.executor.isa, "threads": self.executor.num_threads,
                             "jobs": self.totals["cpu_jobs"], "experts_computed": self.totals["cpu_experts"],
                             "routes_computed": self.totals["cpu_routes"],
                             "worker_cpus": self.executor.worker_cpus,
                             "spare_cpus": sorted(self.executor.confined_to),  # where the other threads run
                             "worker_preemptions": self.executor.worker_preemptions()},
            "fetch_fraction": last.q16 / Q16,  # in use in that bucket (its tuner's once it runs, else its cost model's)
            "bandwidth_bytes_per_second": {"pcie": split["pcie_bytes_per_second"], "cpu": split["cpu_bytes_per_second"]},
            "c_sync_seconds": split["c_sync_seconds"],
        }

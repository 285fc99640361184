"""Every Prometheus metric the engine exports, declared once (vLLM ``v1/metrics/loggers.py`` style).

Names follow docs/design.md §5: prefix ``tandem_``, unit suffixes, label ``model_name``. Torch-free, so the
gateway, tests and tools can import it. Callers stay one-liners through ``EngineMetrics``:

    metrics = EngineMetrics(model_id)
    metrics.observe_step(num_running=3, num_waiting=0, kv_cache_usage=0.2, generation_tokens=3)
    metrics.observe_first_token(0.05); metrics.observe_inter_token(0.02)
    metrics.observe_request_finished(e2e_seconds=1.4, finish_reason="stop")
    metrics.record_backend_stats(backend.stats())   # cumulative counters -> counter increments
    body, content_type = render_metrics()           # for GET /metrics

Backend stats contract (``ExpertBackend.stats()``; every key optional, unknown keys ignored; keys may
sit one level down in a nested dict, e.g. the offload backend's ``{"backend": ..., "cache": {...}}``):
  cumulative since the backend was built (ints):
    hits, misses          routed (token, expert) pairs found / not found in the GPU expert cache
    fetched               misses copied host->GPU (offload, hybrid)
    cpu_computed          misses computed in place by the CPU executor (cpu, hybrid)
    bytes_fetched         bytes copied host->GPU for expert misses
    prefetched            next-layer experts copied host->GPU ahead of their routing (--moe-prefetch); the
                          ones that were right are then hits, so misses and fetched no longer count them
    worker_preemptions    times the kernel took a CPU executor worker's core (cpu, hybrid)
  per MoE layer (optional): "per_layer": {"hits": [L], "misses": [L], "fetched": [L], "cpu_computed": [L]}
    -- a list given there replaces the total for that key (label layer="0".."L-1"; else layer="all")
  current values (floats): slots (cache size), fetch_fraction, pcie_bytes_per_second,
    cpu_bytes_per_second, c_sync_seconds (the split controller's ``stats()``)
  per bucket of tokens per step (optional, hybrid): "buckets": {"1": {"fetch_fraction": f,
    "seconds_per_token": s, ...}, "2": ..., "prefill": ...} -- label bucket; at most log2(max running
    requests) + 2 values (services/engine/moe/split_buckets.py), so the cardinality stays bounded
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from prometheus_client import (CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

# No *_created series: they double the exposition and no panel or rule reads them.
disable_created_metrics()

_M = ["model_name"]
_ML = ["model_name", "layer"]  # layer: MoE-layer ordinal as a string, or "all" when the backend has no split

# --- expert cache and the fetch/CPU split (the point of Tandem) -----------------------------------------
EXPERT_HITS = Counter("tandem_expert_hits_total",
                      "Routed (token, expert) pairs whose expert was already in a GPU cache slot.", _ML)
EXPERT_MISSES = Counter("tandem_expert_misses_total",
                        "Routed (token, expert) pairs whose expert was not in the GPU cache.", _ML)
EXPERT_FETCHED = Counter("tandem_expert_fetched_total",
                         "Missing experts copied host->GPU over PCIe and computed on the GPU.", _ML)
EXPERT_CPU_COMPUTED = Counter("tandem_expert_cpu_computed_total",
                              "Missing experts computed in place by the CPU executor (no copy).", _ML)
EXPERT_PEER_FETCHED = Counter("tandem_expert_peer_fetched_total",
                              "Missing experts copied from a peer GPU's slots (--moe-peer-devices) instead of the "
                              "host; also counted in tandem_expert_fetched_total.", _ML)
EXPERT_FETCHED_BYTES = Counter("tandem_expert_fetched_bytes_total",
                               "Bytes of expert weights copied host->GPU for cache misses.", _M)
EXPERT_PREFETCHED = Counter("tandem_expert_prefetched_total",
                            "Experts of the next MoE layer copied host->GPU ahead of its routing (--moe-prefetch).",
                            _M)
CPU_WORKER_PREEMPTIONS = Counter("tandem_cpu_worker_preemptions_total",
                                 "Times the kernel took a CPU executor worker's core (cpu, hybrid): each stalls that "
                                 "worker's share of a layer; a high rate means other work runs on the workers' cores.",
                                 _M)
HYBRID_FETCH_FRACTION = Gauge("tandem_hybrid_fetch_fraction",
                              "Share f of missing experts sent to the fetch path (docs/design.md §1), 0..1.", _M)
HYBRID_BUCKET_FETCH_FRACTION = Gauge("tandem_hybrid_bucket_fetch_fraction",
                                     "Fetch fraction f per bucket of tokens per step (1, 2, 4, ..., prefill): 1 = the "
                                     "offload path, 0 = every miss on the CPU.", ["model_name", "bucket"])
HYBRID_BUCKET_STEP = Gauge("tandem_hybrid_bucket_seconds_per_token",
                           "Median step time per token of the bucket's last 32 steps (what its split tuner minimises).",
                           ["model_name", "bucket"])
BANDWIDTH = Gauge("tandem_bandwidth_bytes_per_second",
                  "Bandwidth measured online while both paths run: path=pcie (fetch) or path=cpu (in place).",
                  ["model_name", "path"])
HYBRID_SYNC = Gauge("tandem_hybrid_sync_seconds",
                    "c_sync: per-layer CPU submit + sync cost of the hybrid path, current estimate.", _M)
EXPERT_CACHE_SLOTS = Gauge("tandem_expert_cache_slots",
                           "GPU expert cache size in slots (one slot = one expert of one layer).", _M)

# --- serving (mirrors vLLM's names and buckets, with finer low buckets for CPU-only demo runs) -----------
TTFT = Histogram("tandem_time_to_first_token_seconds", "Time from request arrival to its first token.", _M,
                 buckets=[0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                          7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0])
INTER_TOKEN = Histogram("tandem_inter_token_latency_seconds", "Time between two tokens of one request.", _M,
                        buckets=[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                                 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0])
E2E = Histogram("tandem_e2e_request_latency_seconds", "Time from request arrival to its last token.", _M,
                buckets=[0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                         50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0])
PROMPT_TOKENS = Counter("tandem_prompt_tokens_total", "Prompt tokens prefilled.", _M)
PROMPT_TOKENS_CACHED = Counter("tandem_prompt_tokens_cached_total",
                               "Prompt tokens taken from the prefix cache instead of prefilled.", _M)
GENERATION_TOKENS = Counter("tandem_generation_tokens_total", "Tokens generated.", _M)
# The three gauges an endpoint picker reads (Gateway API Inference Extension, model server protocol):
# waiting = TotalQueuedRequests, running = TotalRunningRequests, KV usage = KVCacheUtilization (0..1).
REQUESTS_RUNNING = Gauge("tandem_num_requests_running", "Requests in the running batch (prefilling or decoding), "
                         "as of the last step.", _M)
REQUESTS_WAITING = Gauge("tandem_num_requests_waiting", "Requests accepted but not yet in the running batch "
                         "(queued for a batch slot or KV blocks, preempted ones included), as of the last step "
                         "or scrape.", _M)
KV_USAGE = Gauge("tandem_kv_cache_usage_ratio", "Share of the KV pool's blocks held by running requests, 0..1 "
                 "(vLLM's kv_cache_usage_perc: cached prefix blocks nobody holds count as free).", _M)
PREEMPTIONS = Counter("tandem_num_preemptions_total", "Running requests whose KV blocks were taken back "
                      "(recomputed later) because the pool ran out.", _M)
REQUEST_SUCCESS = Counter("tandem_request_success_total", "Finished requests by finish reason.",
                          ["model_name", "finish_reason"])

FINISH_REASONS = ("stop", "length", "abort")

# backend stats key -> (counter, has a per-layer form)
_BACKEND_COUNTERS: dict[str, tuple[Counter, bool]] = {
    "hits": (EXPERT_HITS, True),
    "misses": (EXPERT_MISSES, True),
    "fetched": (EXPERT_FETCHED, True),
    "cpu_computed": (EXPERT_CPU_COMPUTED, True),
    "peer_fetched": (EXPERT_PEER_FETCHED, True),
    "bytes_fetched": (EXPERT_FETCHED_BYTES, False),
    "prefetched": (EXPERT_PREFETCHED, False),
    "worker_preemptions": (CPU_WORKER_PREEMPTIONS, False),
}


class EngineMetrics:
    """The engine's metrics bound to one ``model_name``; turns engine events into metric updates."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._last: dict[tuple[str, str], float] = {}  # (stats key, layer) -> last cumulative value
        self._lock = threading.Lock()  # two concurrent scrapes must not both add the same delta
        # Create the label children now so every series exists (value 0) from the first scrape on.
        self._preemptions = 0  # the scheduler's total at the last step
        for counter in (PROMPT_TOKENS, PROMPT_TOKENS_CACHED, GENERATION_TOKENS, PREEMPTIONS):
            counter.labels(model_name)
        for hist in (TTFT, INTER_TOKEN, E2E):
            hist.labels(model_name)
        for gauge in (REQUESTS_RUNNING, REQUESTS_WAITING, KV_USAGE):
            gauge.labels(model_name)
        for reason in FINISH_REASONS:  # rate() misses the first increment of a series born at 1
            REQUEST_SUCCESS.labels(model_name, reason)

    def observe_waiting(self, num_waiting: int) -> None:
        """The waiting requests between two steps (at scrape time: one queued meanwhile counts at once)."""
        REQUESTS_WAITING.labels(self.model_name).set(num_waiting)

    def observe_step(self, num_running: int, num_waiting: int, kv_cache_usage: float,
                     prompt_tokens: int = 0, generation_tokens: int = 0, cached_tokens: int = 0,
                     preemptions_total: int | None = None) -> None:
        """After one scheduler step: queue sizes, KV use (0..1), tokens prefilled/generated in the step, the
        scheduler's preemptions so far."""
        m = self.model_name
        if preemptions_total is not None and preemptions_total > self._preemptions:
            PREEMPTIONS.labels(m).inc(preemptions_total - self._preemptions)
            self._preemptions = preemptions_total
        REQUESTS_RUNNING.labels(m).set(num_running)
        REQUESTS_WAITING.labels(m).set(num_waiting)
        KV_USAGE.labels(m).set(kv_cache_usage)
        if prompt_tokens:
            PROMPT_TOKENS.labels(m).inc(prompt_tokens)
        if cached_tokens:
            PROMPT_TOKENS_CACHED.labels(m).inc(cached_tokens)
        if generation_tokens:
            GENERATION_TOKENS.labels(m).inc(generation_tokens)

    def observe_first_token(self, seconds: float) -> None:
        """Time to first token of one request, seconds since it arrived."""
        TTFT.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        """Gap between two consecutive tokens of one request, seconds."""
        INTER_TOKEN.labels(self.model_name).observe(seconds)

    def observe_request_finished(self, e2e_seconds: float, finish_reason: str) -> None:
        """A request ended (finish_reason: stop | length | abort | error), e2e seconds since arrival."""
        E2E.labels(self.model_name).observe(e2e_seconds)
        REQUEST_SUCCESS.labels(self.model_name, finish_reason).inc()

    def record_backend_stats(self, stats: Mapping) -> None:
        """Export one ``ExpertBackend.stats()`` snapshot (contract in the module docstring).

        Counters grow by the difference to the previous snapshot; a value that went down (backend rebuilt
        on profile reload) counts from zero again, as Prometheus treats a counter reset.
        """
        with self._lock:
            self._record_backend_stats(stats)

    def _record_backend_stats(self, stats: Mapping) -> None:
        m = self.model_name
        stats = _flatten(stats)
        layers = stats.get("per_layer") or {}
        for key, (counter, per_layer) in _BACKEND_COUNTERS.items():
            values = layers.get(key) if per_layer else None
            if values is not None:
                for i, value in enumerate(values):
                    self._add(counter.labels(m, str(i)), key, str(i), value)
            elif key in stats:
                child = counter.labels(m, "all") if per_layer else counter.labels(m)
                self._add(child, key, "all", stats[key])
        gauges = {"fetch_fraction": HYBRID_FETCH_FRACTION.labels(m),
                  "pcie_bytes_per_second": BANDWIDTH.labels(m, "pcie"),
                  "cpu_bytes_per_second": BANDWIDTH.labels(m, "cpu"),
                  "c_sync_seconds": HYBRID_SYNC.labels(m),
                  "slots": EXPERT_CACHE_SLOTS.labels(m)}
        for key, gauge in gauges.items():
            if stats.get(key) is not None:
                gauge.set(float(stats[key]))
        buckets = stats.get("buckets")
        if isinstance(buckets, Mapping):
            for name, b in buckets.items():
                if not isinstance(b, Mapping):
                    continue
                if b.get("fetch_fraction") is not None:
                    HYBRID_BUCKET_FETCH_FRACTION.labels(m, str(name)).set(float(b["fetch_fraction"]))
                if b.get("seconds_per_token") is not None:
                    HYBRID_BUCKET_STEP.labels(m, str(name)).set(float(b["seconds_per_token"]))

    def _add(self, child, key: str, layer: str, value) -> None:
        value = float(value)
        last = self._last.get((key, layer), 0.0)
        delta = value - last if value >= last else value
        if delta > 0:
            child.inc(delta)
        self._last[(key, layer)] = value


def _flatten(stats: Mapping) -> dict:
    """Top-level keys plus those of nested dicts one level down (top level wins); "per_layer" and
    "buckets" stay whole."""
    whole = ("per_layer", "buckets")
    flat: dict = {}
    for key, value in stats.items():
        if isinstance(value, Mapping) and key not in whole:
            for inner_key, inner in value.items():
                flat.setdefault(inner_key, inner)
    flat.update({k: v for k, v in stats.items() if not (isinstance(v, Mapping) and k not in whole)})
    return flat


def render_metrics() -> tuple[bytes, str]:
    """The exposition text of this process's metrics and its content type (for ``GET /metrics``)."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

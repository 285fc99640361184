"""Routing workloads for the cache simulator (benchmarks/sim_expert_cache.py): a trace the engine recorded
(``tandem serve --record-routing``), a routing preset's process at a model's geometry, and a preset fitted to a
trace (``--fit``: what turns a user's real model into a synthetic benchmark workload, ``routing=file:PATH``).

The simulator's trace is a dict: layers, experts, calls ([layer, *expert ids] per backend call, in order),
prefill_calls / last_request_start / tokens (where the measured part starts).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from benchmarks import routing_stats
from services.engine.moe.routing_presets import RoutingTables
from services.engine.runtime.routing_trace import read_trace


def from_engine_trace(path: Path) -> dict:
    """The engine's calls, every one measured (what its hit and miss counters counted)."""
    trace = read_trace(path)
    return {"model": trace.header["model"], "layers": trace.layers, "experts": trace.experts,
            "prefill_calls": 0, "last_request_start": 0, "tokens": len(trace.steps), "requests": 1,
            "calls": trace.calls()}


def from_preset(model: str, tokens: int, prompt_len: int, requests: int) -> dict:
    """``requests`` requests of ``model`` (synthetic:NAME?routing=...) back to back at batch 1: a prompt call per
    layer, then one call per layer and token (the shape record_trace gives a real decode)."""
    from services.engine.models.synthetic import parse_options, synthetic_spec
    from services.engine.moe import routing_presets

    spec = synthetic_spec(model, tokenizer_vocab=1)
    _, options = parse_options(model)
    seed = int(options.get("seed", 0))
    tables = routing_presets.parse(options.get("routing", "uniform"), spec.num_moe_layers, spec.num_experts, seed)
    if tables is None:
        raise ValueError(f"{model}: uniform routing comes from the model's router: trace it (--model without --preset)")
    L, calls, last_start = spec.num_moe_layers, [], 0
    for r in range(requests):
        ids = routing_stats.preset_ids(tables, spec.top_k, prompt_len + tokens, seed, request=f"request-{r}")
        last_start = len(calls)
        calls += [[layer, *ids[layer, :prompt_len].reshape(-1).tolist()] for layer in range(L)]
        calls += [[layer, *ids[layer, t].tolist()] for t in range(prompt_len, prompt_len + tokens) for layer in range(L)]
    return {"model": model, "layers": L, "experts": spec.num_experts, "prefill_calls": L, "tokens": tokens,
            "requests": requests, "last_request_start": last_start, "calls": calls}


def fit(sequences: list[np.ndarray], num_experts: int, top_k: int) -> RoutingTables:
    """A preset that routes like ``sequences`` (each [L, N, A]): per layer the measured popularity (add-half
    smoothed, so no expert is impossible) and the ``stay`` whose process repeats picks at the next token as often
    as the trace does (solved from a run at stay 0, then refined once on the process itself)."""
    L = sequences[0].shape[0]
    counts = np.full((L, num_experts), 0.5)
    for seq in sequences:
        for layer in range(L):
            counts[layer] += np.bincount(seq[layer].reshape(-1), minlength=num_experts)
    popularity = torch.tensor(counts / counts.sum(1, keepdims=True))
    target = np.array([np.mean([routing_stats.repeat_rate(s[layer:layer + 1]) for s in sequences]) for layer in range(L)])
    tokens = max(256, min(1024, max(s.shape[1] for s in sequences)))

    def repeats(stay: np.ndarray) -> np.ndarray:
        ids = routing_stats.preset_ids(RoutingTables(torch.tensor(stay), popularity), top_k, tokens)
        return np.array([routing_stats.repeat_rate(ids[layer:layer + 1]) for layer in range(L)])

    base = repeats(np.zeros(L))
    stay = np.clip((target - base) / np.maximum(1e-6, 1 - base), 0.0, 0.95)
    got = repeats(stay)  # the lanes and the collisions bend the first guess: one secant-free correction
    stay = np.clip(stay + (target - got) / np.maximum(1e-6, 1 - base), 0.0, 0.95)
    return RoutingTables(torch.tensor(stay), popularity)

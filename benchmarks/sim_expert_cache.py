"""Would another expert-cache policy miss less? Replays a routing trace of a real decode through the slot
cache, as the kernels run it and with other eviction and fetch orders.

1. trace: decode ``--tokens`` tokens of ``--model`` on the CPU (sampled at T 0.7 / top-p 0.8 / top-k 20, a
   random prompt of ``--prompt-len`` tokens) and record the experts every MoE layer routes to, per call;
   ``--requests N`` traces N such requests (other prompts) back to back through the one cache, as a
   server sees them, and measures the last; ``--trace-out`` keeps it, ``--trace`` replays a kept one.
2. replay: one pool of S = ceil(r·L·E) slots shared by all layers (services/engine/moe/cache.py), per call
   the layer's hits, then F of its M misses fetched into slots (offload: F = M; hybrid: F from the fetch
   fraction f, the rule of kernels/ensure_experts_hybrid.py), the others computed on the CPU. Policies:
     - evict ``lru``: least recently used slot, lowest index first (kernels/ensure_experts.py under
       ``--moe-cache-policy lru``), or ``lfu`` (the engine's default): the slot whose expert was routed to
       least often so far, then least recently used;
     - fetch ``lowest-id``: hybrid fetches the misses with the lowest expert ids (the kernels under lru), or
       ``most-used``: the misses routed to most often so far;
     - and, as the bound no policy can beat, evict ``belady``: the slot whose expert is routed to again
       last (or never), read from the trace's future.
   ``lru`` + ``lowest-id`` replays the engine's counters under ``--moe-cache-policy lru`` call for call, and
   ``lfu`` + ``most-used`` those of ``lfu`` (tests/benchmarks/test_sim_expert_cache.py checks both against a
   real offload and hybrid backend).

    python -m benchmarks.sim_expert_cache --model 'synthetic:qwen3-moe-mini?layers=24' --tokens 512 \
        --cache-rate 0.33 --fetch-fraction 1,0.28 [--trace-out trace.json]

Miss rates are over the last request's decode tokens after ``--warmup`` of them (the cache's start fills
it). Every miss is an expert's bytes read from host DRAM (fetched or computed in place), so on a host
where those reads bound decode (hybrid, offload), tok/s follows 1 / miss rate.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from kernels.ensure_experts_ref import USE_CAP, USE_SHIFT, check_use_cap
from benchmarks import routing_workloads
from services.engine.moe.hybrid_split import split_max_tokens  # above: a call takes the offload path (every miss fetched)

from services.engine.runtime.routing_trace import MAGIC as ROUTING_MAGIC, read_trace

Q16 = 1 << 16
_PROTECTED = 1 << 62  # a slot hit or taken in this call: never the victim
_NEVER = 1 << 61  # belady: the next use of an expert not routed to again
EVICT = ("lru", "lfu", "belady")
FETCH = ("lowest-id", "most-used")


def record_trace(lm, tokens: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """Decode ``tokens`` tokens after a random prompt on ``lm`` (a LoadedModel on the CPU); returns one
    ``[layer, *expert ids of all its rows]`` per call of a MoE layer, in order (prefill: one call per layer)."""
    from services.engine.runtime.kv_cache import ForwardBatch, KVCache

    calls: list[list[int]] = []
    backend = lm.model.backend
    forward = backend.forward

    def recording(layer, hidden, topk_ids, topk_weights):
        calls.append([layer] + topk_ids.reshape(-1).tolist())
        return forward(layer, hidden, topk_ids, topk_weights)

    gen = torch.Generator().manual_seed(seed)

    def sample(logits: torch.Tensor) -> int:  # T 0.7, top-k 20, top-p 0.8: the synthetic presets' sampling
        top = torch.topk(logits[-1].float() / 0.7, 20)
        p = torch.softmax(top.values, -1)
        p = p * (torch.cumsum(p, -1) - p < 0.8)
        return int(top.indices[torch.multinomial(p / p.sum(), 1, generator=gen)])

    backend.forward = recording
    try:
        kv = KVCache(lm.spec, 1, prompt_len + tokens + 1, "cpu", lm.dtype)
        prompt = torch.randint(0, lm.spec.vocab_size, (prompt_len,), generator=gen)
        token = sample(lm.model(prompt, torch.arange(prompt_len), ForwardBatch.single(0, 0, prompt_len), kv))
        for pos in tqdm(range(prompt_len, prompt_len + tokens), desc="trace", unit="token", file=sys.stderr):
            logits = lm.model(torch.tensor([token]), torch.tensor([pos]),
                              ForwardBatch(slots=[0], start_pos=[pos], query_lens=[1]), kv)
            token = sample(logits)
    finally:
        backend.forward = forward
    return calls


class SlotCache:
    """The slot cache's tables and one policy, in numpy: ``call(layer, routes)`` is one backend call."""

    def __init__(self, num_layers: int, num_experts: int, num_slots: int, fetch_fraction: float = 1.0,
                 max_fetch: int = -1, evict: str = "lru", fetch: str = "lowest-id", use_cap: int = USE_CAP,
                 top_k: int = 8, max_running_requests: int = 8):
        if evict not in EVICT or fetch not in FETCH:
            raise ValueError(f"unknown policy: evict {evict!r}, fetch {fetch!r}")
        check_use_cap(use_cap)
        self.use_cap = use_cap  # every layer's counts halve when one reaches it (--moe-cache-lfu-cap)
        # a call of more routes takes the offload path (hybrid_split.py: the automatic split reaches prompt chunks)
        self.max_split_routes = split_max_tokens(max_fetch < 0, max_running_requests) * top_k
        self.E, self.S = num_experts, num_slots
        self.q16, self.max_fetch, self.evict, self.fetch = round(fetch_fraction * Q16), max_fetch, evict, fetch
        self.slot_of_id = np.full(num_layers * num_experts, -1, dtype=np.int64)
        self.id_of_slot = np.full(num_slots, -1, dtype=np.int64)
        self.last_use = np.zeros(num_slots, dtype=np.int64)
        self.uses = np.zeros(num_layers * num_experts, dtype=np.int64)  # routed-to count per expert (the kernels')
        self.next_use = np.full(num_layers * num_experts, _NEVER, dtype=np.int64)  # belady: the call routing it next
        self.clock = 0
        self.hits = self.misses = 0
        self.layer_hits = np.zeros(num_layers, dtype=np.int64)
        self.layer_misses = np.zeros(num_layers, dtype=np.int64)

    def _fetch_count(self, M: int, n_hit: int) -> int:
        """F of kernels/ensure_experts_hybrid.py: lo or lo + 1, whichever balances the two sides better."""
        q = self.q16
        lo = (M * q) >> 16
        F = lo if max(lo * (Q16 - q), (M - lo) * q) <= max((lo + 1) * (Q16 - q), (M - lo - 1) * q) else lo + 1
        F = min(F, M, self.S - n_hit)
        return min(F, self.max_fetch) if self.max_fetch >= 0 else F

    def call(self, layer: int, routes: list[int], next_use: dict[int, int] | None = None) -> None:
        """One backend call of ``layer`` routing to ``routes`` (expert ids, -1 skipped); belady needs
        ``next_use``: for each expert routed here, the index of the next call that routes to it."""
        base = layer * self.E
        present = sorted({e for e in routes if 0 <= e < self.E})
        for e, when in (next_use or {}).items():
            self.next_use[base + e] = when
        if len(routes) > self.max_split_routes or (self.q16 >= Q16 and self.max_fetch < 0):
            chunk = min(self.E, self.S)  # offload (or a prefill): every miss, chunk by chunk of present experts
            for start in range(0, len(present), chunk):
                part = present[start:start + chunk]
                self._ensure(base, *self._lookup(base, part))
                self._count(base, part)  # after the chunk's evictions, as kernels/ensure_experts.py
        else:
            hits, missed = self._lookup(base, present)
            order = sorted(missed, key=lambda e: -self.uses[base + e]) if self.fetch == "most-used" else missed
            fetched = sorted(order[:self._fetch_count(len(missed), len(hits))])
            self._count(base, present)  # in the split, before the evictions, as kernels/ensure_experts_hybrid.py
            self._ensure(base, hits, fetched)

    def _count(self, base: int, experts: list[int]) -> None:
        """One use per expert; every layer's counts halved once one of these reaches use_cap (as the kernels)."""
        layer = self.uses[base: base + self.E]
        layer[experts] += 1
        if layer.max() >= self.use_cap:
            self.uses >>= 1

    def _lookup(self, base: int, experts: list[int]) -> tuple[list[int], list[int]]:
        """(cached, missed) among ``experts``, counted."""
        cached = [e for e in experts if self.slot_of_id[base + e] >= 0]
        missed = [e for e in experts if self.slot_of_id[base + e] < 0]
        self.hits += len(cached)
        self.misses += len(missed)
        self.layer_hits[base // self.E] += len(cached)
        self.layer_misses[base // self.E] += len(missed)
        return cached, missed

    def _ensure(self, base: int, hits: list[int], fetch: list[int]) -> None:
        """kernels/ensure_experts.py for one chunk: hits refreshed, each fetched miss takes the victim slot."""
        now = self.clock = self.clock + 1
        self.last_use[self.slot_of_id[[base + e for e in hits]]] = now
        if self.evict == "lfu":
            key = (self.uses[self.id_of_slot] << USE_SHIFT) | (self.last_use & ((1 << USE_SHIFT) - 1))
        elif self.evict == "belady":  # the farthest next use first
            key = -self.next_use[self.id_of_slot]
        else:
            key = self.last_use
        key = np.where(self.id_of_slot < 0, -_NEVER - 1, key)  # empty slots before every key of every policy
        key[self.last_use == now] = _PROTECTED
        for e in fetch:
            victim = int(np.argmin(key))  # the lowest index among the smallest keys
            old = self.id_of_slot[victim]
            if old >= 0:
                self.slot_of_id[old] = -1
            self.slot_of_id[base + e], self.id_of_slot[victim] = victim, base + e
            self.last_use[victim], key[victim] = now, _PROTECTED

    @property
    def miss_rate(self) -> float:
        return self.misses / max(1, self.hits + self.misses)


def next_uses(calls: list[list[int]]) -> list[dict[int, int]]:
    """Per call, for each expert it routes to, the index of the next call of that layer that does again."""
    ahead: dict[tuple[int, int], int] = {}
    out: list[dict[int, int]] = [{}] * len(calls)
    for i in range(len(calls) - 1, -1, -1):
        layer, *routes = calls[i]
        present = {e for e in routes if e >= 0}
        out[i] = {e: ahead.get((layer, e), _NEVER) for e in present}
        ahead.update({(layer, e): i for e in present})
    return out


def replay(trace: dict, cache_rate: float, fetch_fraction: float, evict: str, fetch: str, warmup: int,
           max_fetch: int = -1, use_cap: int = USE_CAP) -> dict:
    """Miss rate of one policy over the trace's decode calls after ``warmup`` tokens."""
    L, E = trace["layers"], trace["experts"]
    cache = SlotCache(L, E, math.ceil(cache_rate * L * E), fetch_fraction, max_fetch, evict, fetch, use_cap)
    calls = trace["calls"]
    future = next_uses(calls) if evict == "belady" else [None] * len(calls)
    first_measured = trace["last_request_start"] + trace["prefill_calls"] + warmup * L
    hits = misses = 0
    layer_hits, layer_misses = np.zeros(L, dtype=np.int64), np.zeros(L, dtype=np.int64)
    for i, (layer, *routes) in enumerate(calls):
        if i == first_measured:
            hits, misses = cache.hits, cache.misses
            layer_hits, layer_misses = cache.layer_hits.copy(), cache.layer_misses.copy()
        cache.call(layer, routes, future[i])
    measured = (cache.hits - hits) + (cache.misses - misses)
    per_layer = (cache.layer_misses - layer_misses) / np.maximum(1, cache.layer_hits - layer_hits
                                                                 + cache.layer_misses - layer_misses)
    return {"fetch_fraction": fetch_fraction, "evict": evict, "fetch": fetch, "slots": cache.S,
            "miss_rate": (cache.misses - misses) / max(1, measured), "per_layer_miss_rate": per_layer.round(4).tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="synthetic:qwen3-moe-mini?layers=24",
                   help="model to trace on the CPU (default: %(default)s: Qwen3-30B-A3B's routing geometry at an "
                        "eighth of the width)")
    p.add_argument("--dtype", default="float32", help="dtype of the traced model (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=512, help="decode tokens traced (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=132, help="prompt tokens before them (default: %(default)s)")
    p.add_argument("--requests", type=int, default=1,
                   help="requests traced back to back, each with its own random prompt; the last is measured "
                        "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=384,
                   help="decode tokens replayed before the miss rate is counted (default: %(default)s, as "
                        "bench_decode_moe's warm-up request)")
    p.add_argument("--cache-rate", default="0.33",
                   help="comma list of shares of all experts with a slot (default: %(default)s)")
    p.add_argument("--fetch-fraction", default="1,0.28",
                   help="comma list of f: 1 = offload, below = hybrid's split (default: %(default)s)")
    p.add_argument("--lfu-cap", type=int, default=USE_CAP,
                   help="lfu's use counts, every layer's, halve when one reaches this (the engine's "
                        "--moe-cache-lfu-cap; lower ages faster) (default: %(default)s)")
    p.add_argument("--trace", type=Path,
                   help="replay this trace instead of tracing: one from --trace-out, or a routing trace the engine "
                        "recorded (tandem serve --record-routing DIR; every call measured, --warmup 0)")
    p.add_argument("--fit", type=Path, metavar="TRACE",
                   help="fit a routing preset to this engine routing trace and write it to --out (serve it as "
                        "synthetic:NAME?routing=file:PATH at the trace's geometry)")
    p.add_argument("--out", type=Path, help="--fit: where the preset goes")
    p.add_argument("--trace-out", type=Path, help="write the trace here")
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args(argv)
    if args.fit:
        return fit_preset(p, args.fit, args.out)
    try:
        fractions = [float(f) for f in args.fetch_fraction.split(",")]
        rates = [float(r) for r in args.cache_rate.split(",")]
    except ValueError:
        p.error("--fetch-fraction and --cache-rate: expected comma lists of numbers")
    if args.requests < 1:
        p.error(f"--requests must be at least 1, got {args.requests}")
    if not 2 <= args.lfu_cap <= USE_CAP:
        p.error(f"--lfu-cap must be in [2, {USE_CAP}], got {args.lfu_cap}")
    if not all(0 <= f <= 1 for f in fractions) or not all(0 < r <= 1 for r in rates):
        p.error("--fetch-fraction values and --cache-rate must lie in [0, 1] (cache rate above 0)")
    if args.trace and args.trace.read_bytes()[:len(ROUTING_MAGIC)] == ROUTING_MAGIC:
        trace = routing_workloads.from_engine_trace(args.trace)
        args.warmup = 0
    elif args.trace:
        trace = json.loads(args.trace.read_text())
    elif "routing=" in args.model and "routing=uniform" not in args.model:  # the preset's process: no model to run
        trace = routing_workloads.from_preset(args.model, args.tokens, args.prompt_len, args.requests)
    else:
        trace = record_model_trace(args)
    if args.trace_out:
        args.trace_out.write_text(json.dumps(trace))
    if args.warmup and args.warmup >= trace["tokens"]:
        p.error(f"--warmup {args.warmup} leaves none of the trace's {trace['tokens']} tokens to measure")
    rows = [row for rate in rates for row in report(trace, rate, fractions, args)]
    if args.json:
        args.json.write_text(json.dumps({"model": trace["model"], "tokens": trace["tokens"], "lfu_cap": args.lfu_cap,
                                         "rows": rows}, indent=2))
    return 0


def record_model_trace(args) -> dict:
    """Trace ``args.requests`` requests of ``args.model`` decoding on the CPU (its router's own routing)."""
    from services.engine.config import EngineConfig
    from services.engine.models.registry import load_model

    lm = load_model(EngineConfig(model=args.model, device="cpu", dtype=args.dtype, moe_backend="resident",
                                 max_seq_len=args.prompt_len + args.tokens + 1))
    L = len(lm.banks.layers)
    calls, last_start = [], 0
    for request in range(args.requests):  # one cache sees them all: the replay carries it across
        last_start = len(calls)
        calls += record_trace(lm, args.tokens, args.prompt_len, seed=request)
    return {"model": args.model, "layers": L, "experts": lm.banks.layers[0].num_experts, "prefill_calls": L,
            "tokens": args.tokens, "requests": args.requests, "last_request_start": last_start, "calls": calls}


def fit_preset(p: argparse.ArgumentParser, path: Path, out: Path | None) -> int:
    """--fit: a preset from an engine routing trace, with the trace's and the preset's statistics side by side."""
    from benchmarks import routing_stats

    if out is None:
        p.error("--fit needs --out PATH for the preset")
    try:
        trace = read_trace(path)
    except (OSError, ValueError) as e:
        p.error(str(e))
    sequences = [s for s in trace.sequences().values() if s.shape[1] >= 2]
    if not sequences:
        p.error(f"{path}: no request of two or more tokens to fit")
    tables = routing_workloads.fit(sequences, trace.experts, trace.top_k)
    tables.save(out, source=f"fitted to {path.name} ({trace.header['model']}, {len(sequences)} requests)")
    fitted = routing_stats.preset_ids(tables, trace.top_k, max(s.shape[1] for s in sequences))
    print(f"{path.name}: {trace.header['model']}, {len(sequences)} requests, {trace.layers} MoE layers x "
          f"{trace.experts} experts, top-{trace.top_k} -> {out}")
    print(f"{'':>22} | {'trace':>6} | {'preset':>6}")
    longest = max(sequences, key=lambda s: s.shape[1])
    warm = min(64, longest.shape[1] // 2)
    for label, fn in [("next-token repeats", routing_stats.repeat_rate)] + [
            (f"LRU hits at {share:.0%}", lambda ids, share=share: routing_stats.lru_hits(ids, trace.experts, share, warm))
            for share in (0.1, 0.25, 0.4)]:
        print(f"{label:>22} | {fn(longest):6.3f} | {fn(fitted):6.3f}")
    return 0


def report(trace: dict, cache_rate: float, fractions: list[float], args) -> list[dict]:
    """Replay every policy at one cache share; print the table and return its rows."""
    rows = [replay(trace, cache_rate, f, evict, fetch, args.warmup, use_cap=args.lfu_cap)
            for f in fractions for evict in EVICT for fetch in FETCH
            if (f < 1 and evict != "belady") or fetch == "lowest-id"]  # offload: no order to choose
    print(f"{trace['model']}: {trace['requests']} x {trace['tokens']} decode tokens, {rows[0]['slots']} slots "
          f"({cache_rate:.0%} of {trace['layers']} x {trace['experts']} experts), measured after {args.warmup}, "
          f"lfu cap {args.lfu_cap}")
    print(f"{'f':>5} | {'evict':>6} | {'fetch':>9} | miss rate | vs lru + lowest-id (--moe-cache-policy lru) "
          "(belady: the bound, it reads the future)")
    for r in rows:
        base = next(b for b in rows if b["fetch_fraction"] == r["fetch_fraction"] and b["evict"] == "lru"
                    and b["fetch"] == "lowest-id")
        print(f"{r['fetch_fraction']:5.2f} | {r['evict']:>6} | {r['fetch']:>9} | {r['miss_rate']:9.3f} | "
              f"{r['miss_rate'] / base['miss_rate'] - 1:+.1%}")
    return [{"cache_rate": cache_rate, **r} for r in rows]


if __name__ == "__main__":
    sys.exit(main())

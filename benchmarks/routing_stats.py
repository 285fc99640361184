"""What a routing looks like to a cache: the statistics published measurements of real MoE models quote, computed
on one sequence's expert ids per layer (``ids`` [L, N, A]: layer, token, pick), from a routing trace or from a
routing preset's process (``preset_ids``).

  - ``repeat_rate``: share of a token's picks that the previous token of the layer also picked;
  - ``lru_hits``: hit rate of a per-layer LRU cache of ``share`` x E experts, counted after ``warmup`` tokens
    (0: cold, from an empty cache);
  - ``oracle_hits``: the same cache holding the layer's most used experts of the whole sequence (a frequency
    oracle: the best a static, popularity-based placement can do);
  - ``live_experts``: distinct experts a layer used; ``reuse_within``: share of repeat uses within k tokens.

docs/routing.md's calibration table is these functions on the presets (tests/engine/moe/test_routing_presets.py).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from services.engine.moe.routing_presets import RoutingTables, SyntheticRouting


def preset_ids(tables: RoutingTables, top_k: int, tokens: int, seed: int = 0, request: str = "r0") -> np.ndarray:
    """[L, tokens, A] expert ids of one request of ``tokens`` tokens under ``tables`` (positions 0..tokens-1), as
    the engine's process draws them (synthetic_route_ref: the weights do not matter here)."""
    from kernels.synthetic_route import synthetic_route_ref

    routing = SyntheticRouting(tables, "stats", seed, top_k, True, torch.device("cpu"), max_slots=1)
    routing.assign([0], [request])
    E = tables.popularity.shape[1]
    logits, pos, slots = torch.zeros(tokens, E), torch.arange(tokens), torch.zeros(tokens, dtype=torch.long)
    return np.stack([synthetic_route_ref(logits, pos, slots, routing.salt, routing.keys[layer], routing.stay[layer],
                                         routing.cdf[layer], routing.perm[layer], top_k, True)[1].numpy()
                     for layer in range(len(routing.stay))])


def repeat_rate(ids: np.ndarray) -> float:
    """Share of picks at token t >= 1 that token t-1 of the same layer picked too (all layers)."""
    prev, cur = ids[:, :-1, :], ids[:, 1:, :]
    return float((cur[..., :, None] == prev[..., None, :]).any(-1).mean())


def lru_hits(ids: np.ndarray, num_experts: int, share: float, warmup: int = 64) -> float:
    """Mean over layers of a per-layer LRU cache's hit rate (round(share x E) slots, a token's picks looked up
    then inserted), over tokens >= ``warmup``."""
    slots = max(1, round(share * num_experts))
    hits = total = 0
    for layer in ids:
        cache: OrderedDict[int, None] = OrderedDict()
        for t, token in enumerate(layer):
            for e in token.tolist():
                if e in cache:
                    cache.move_to_end(e)
                    hits += t >= warmup
                else:
                    cache[e] = None
                    if len(cache) > slots:
                        cache.popitem(last=False)
                total += t >= warmup
    return hits / max(1, total)


def oracle_hits(ids: np.ndarray, num_experts: int, share: float) -> float:
    """Hit rate of a cache holding each layer's round(share x E) most used experts of the whole sequence."""
    slots = max(1, round(share * num_experts))
    hits = 0
    for layer in ids:
        counts = np.bincount(layer.reshape(-1), minlength=num_experts)
        hits += int(np.sort(counts)[::-1][:slots].sum())
    return hits / ids.size


def live_experts(ids: np.ndarray) -> float:
    """Mean over layers of the distinct experts used."""
    return float(np.mean([len(np.unique(layer)) for layer in ids]))


def reuse_within(ids: np.ndarray, k: int) -> float:
    """Of the picks whose expert the layer used before, the share used within the last k tokens."""
    near = again = 0
    for layer in ids:
        last: dict[int, int] = {}
        for t, token in enumerate(layer):
            for e in token.tolist():
                if e in last:
                    again += 1
                    near += t - last[e] <= k
            for e in token.tolist():
                last[e] = t
    return near / max(1, again)


def calibration_rows(tokens: int = 1024, layers: int = 4) -> list[dict]:
    """docs/routing.md's calibration table: each preset's published targets and what its process gives."""
    from services.engine.moe.routing_presets import PRESETS

    def ids(name: str, E: int, A: int) -> np.ndarray:
        return preset_ids(RoutingTables.from_preset(PRESETS[name], layers, E, seed=0), A, tokens)

    sticky, moderate, flat = ids("sticky", 128, 8), ids("moderate", 512, 10), ids("flat", 128, 4)
    rows = [("sticky", "Qwen3-30B-A3B (128 experts, top-8)", "next-token repeats", "45 %", repeat_rate(sticky)),
            ("sticky", "", "reuses within 8 tokens", "80 %", reuse_within(sticky, 8)),
            ("sticky", "", "LRU hits at 40 % cached, warm", "90-95 %", lru_hits(sticky, 128, 0.40))]
    rows += [("sticky", "", f"LRU hits at {share:.0%} cached, cold over 256 tokens", target,
              lru_hits(sticky[:, :256], 128, share, warmup=0))
             for share, target in ((0.06, "36 %"), (0.19, "74 %"), (0.38, "89 %"), (0.64, "96 %"))]
    rows += [("moderate", "Qwen3.8-Flash-Next (512 experts, top-10)" if share == 0.18 else "",
              f"LRU hits at {share:.0%} cached", target, lru_hits(moderate, 512, share))
             for share, target in ((0.18, "43 %"), (0.36, "62 %"), (0.54, "72 %"), (0.73, "79 %"))]
    rows += [("flat", "gpt-oss-120b (128 experts, top-4)", "LRU hits at 5 % cached", "8-18 %", lru_hits(flat, 128, 0.05)),
             ("flat", "", "frequency oracle at 5 % cached", "40-52 %", oracle_hits(flat, 128, 0.05)),
             ("flat", "", "experts live per layer", "240-248 of 256 (94-97 %)", live_experts(flat) / 128)]
    return [dict(preset=p, model=m, statistic=s, published=t, measured=round(float(v), 3)) for p, m, s, t, v in rows]


if __name__ == "__main__":  # python -m benchmarks.routing_stats: the calibration table, as docs/routing.md shows it
    print("| preset | stands for | statistic | published | this process |\n|---|---|---|---|---|")
    for r in calibration_rows():
        print(f"| {r['preset']} | {r['model']} | {r['statistic']} | {r['published']} | {r['measured']:.0%} |")

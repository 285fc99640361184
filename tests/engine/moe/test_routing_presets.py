"""Routing presets (services/engine/moe/routing_presets.py): each preset meets its published calibration points
(simulated on the process the engine runs); a synthetic model with a preset serves through every backend with
the same tokens and the routing the preset says; bad names and files get one clear error."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from benchmarks import routing_stats
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models.errors import LoaderError
from services.engine.models.synthetic import parse_options
from services.engine.moe.routing_presets import PRESETS, RoutingTables, parse
from tests.engine.runtime.test_long_prompts import generate, prompt_of


def ids_of(name: str, E: int, A: int, layers: int = 4, tokens: int = 512):
    return routing_stats.preset_ids(RoutingTables.from_preset(PRESETS[name], layers, E, seed=0), A, tokens)


def test_sticky_routes_like_qwen3_30b_a3b():
    ids = ids_of("sticky", 128, 8)  # Qwen3-30B-A3B: 128 experts, top-8
    assert abs(routing_stats.repeat_rate(ids) - 0.45) <= 0.05
    assert routing_stats.lru_hits(ids, 128, 0.40, warmup=64) >= 0.88
    assert routing_stats.reuse_within(ids, 8) >= 0.75  # published: 80 % of reuses within 8 tokens


def test_moderate_follows_the_512_expert_lru_curve():
    ids = ids_of("moderate", 512, 10, layers=3, tokens=768)  # Qwen3.8-Flash-Next: 512 experts, top-10
    for share, published in ((0.18, 0.43), (0.36, 0.62), (0.54, 0.72), (0.73, 0.79)):
        assert abs(routing_stats.lru_hits(ids, 512, share) - published) <= 0.05, share


def test_flat_defeats_lru_but_not_a_frequency_oracle():
    ids = ids_of("flat", 128, 4)  # gpt-oss-120b: 128 experts, top-4
    assert routing_stats.lru_hits(ids, 128, 0.05) <= 0.20
    assert routing_stats.oracle_hits(ids, 128, 0.05) >= 2 * routing_stats.lru_hits(ids, 128, 0.05)
    assert routing_stats.live_experts(ids) >= 0.95 * 128


def test_uniform_is_the_routers_own_and_bad_names_are_refused(tmp_path):
    assert parse("uniform", 2, 8, 0) is None
    for bad in ("synthetic:tiny?routing=zipf", "synthetic:tiny?seed=x", "synthetic:tiny?routing"):
        with pytest.raises(LoaderError, match="synthetic:tiny"):
            parse_options(bad)
    with pytest.raises(LoaderError, match="cannot read"):
        parse(f"file:{tmp_path / 'missing.json'}", 2, 8, 0)
    (tmp_path / "bad.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(LoaderError, match="not a routing preset"):
        parse(f"file:{tmp_path / 'bad.json'}", 2, 8, 0)
    RoutingTables.from_preset(PRESETS["flat"], 3, 8, 0).save(tmp_path / "p.json", "test")
    with pytest.raises(LoaderError, match="3 MoE layers x 8 experts"):
        parse(f"file:{tmp_path / 'p.json'}", 2, 8, 0)
    loaded = parse(f"file:{tmp_path / 'p.json'}", 3, 8, 0)
    torch.testing.assert_close(loaded.popularity, RoutingTables.from_preset(PRESETS["flat"], 3, 8, 0).popularity)


MODEL = "synthetic:qwen3-moe-mini?layers=2&routing=sticky&seed=1"


def _serve_and_count(backend: str, model: str = MODEL) -> tuple[list[int], dict]:
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.4}
    engine = Engine(EngineConfig(model=model, device="cpu", dtype="float32", moe_backend=backend, **extra))
    engine.start()
    engine.wait_ready(120)
    try:
        tokens, _ = asyncio.run(generate(engine, "routed", prompt_of(24, seed=2), 48))
        return tokens, asyncio.run(engine.stats())
    finally:
        engine.shutdown()


def test_a_preset_serves_through_every_backend_with_the_same_tokens():
    tokens = {backend: _serve_and_count(backend)[0] for backend in ("resident", "offload", "cpu", "hybrid", "auto")}
    assert len(set(map(tuple, tokens.values()))) == 1, tokens


def test_sticky_routing_misses_less_than_uniform_in_the_engines_cache():
    _, sticky = _serve_and_count("offload")
    _, uniform = _serve_and_count("offload", MODEL.replace("routing=sticky", "routing=uniform"))
    assert sticky["expert_cache"]["hit_rate"] > uniform["expert_cache"]["hit_rate"] + 0.2
    assert sticky["expert_cache"]["hit_rate"] > 0.75

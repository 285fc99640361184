"""Routing traces (--record-routing): a trace recorded while serving a synthetic model replays through the
cache simulator to exactly the engine's hit and miss counters; its sequences are the preset's process; --fit
turns it into a preset file the engine serves; a bounded trace stops whole; a corrupt file is named."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from benchmarks import routing_stats, routing_workloads
from benchmarks.sim_expert_cache import SlotCache, main as sim_main
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.moe.routing_presets import PRESETS, RoutingTables
from services.engine.runtime.routing_trace import read_trace
from tests.engine.runtime.test_long_prompts import generate, prompt_of

MODEL = "synthetic:qwen3-moe-mini?layers=2&routing=sticky"


def serve(tmp_path, **cfg) -> Engine:
    engine = Engine(EngineConfig(model=MODEL, device="cpu", dtype="float32", moe_backend="offload",
                                 moe_cache_rate=0.3, record_routing=str(tmp_path), max_prefill_tokens=32, **cfg))
    engine.start()
    engine.wait_ready(120)
    return engine


def test_a_recorded_trace_replays_to_the_engines_counters_and_fits_a_preset(tmp_path):
    engine = serve(tmp_path)
    try:
        async def three():  # concurrent: batched decode steps, one prompt in two chunks
            return await asyncio.gather(*(generate(engine, f"r{i}", prompt_of(n, seed=i), 40)
                                          for i, n in enumerate((20, 50, 12))))

        asyncio.run(three())
        counters = asyncio.run(engine.stats())["expert_cache"]
        slots = engine.loaded.model.backend.cache.state.num_slots
    finally:
        engine.shutdown()
    [path] = tmp_path.glob("routing-*.trace")
    trace = read_trace(path)
    assert trace.header["model"] == MODEL and (trace.layers, trace.experts, trace.top_k) == (2, 128, 8)
    sim = SlotCache(trace.layers, trace.experts, slots, evict="lfu", fetch="most-used")
    for layer, *routes in trace.calls():
        sim.call(layer, routes)
    assert (sim.hits, sim.misses) == (counters["hits"], counters["misses"])
    assert sim.layer_hits.tolist() == counters["per_layer"]["hits"]

    seqs = trace.sequences()
    assert sorted(seqs) == ["r0", "r1", "r2"] and seqs["r1"].shape == (2, 50 + 39, 8)  # the last token is not computed
    sticky = RoutingTables.from_preset(PRESETS["sticky"], 2, 128, seed=0)
    assert np.array_equal(seqs["r1"], routing_stats.preset_ids(sticky, 8, 89, request="r1"))  # the process itself

    preset = tmp_path / "fitted.json"
    assert sim_main(["--fit", str(path), "--out", str(preset)]) == 0
    fitted = RoutingTables.load(preset)
    assert fitted.popularity.shape == (2, 128)
    ids = routing_stats.preset_ids(fitted, 8, 256)
    assert abs(routing_stats.repeat_rate(ids) - routing_stats.repeat_rate(seqs["r1"])) < 0.08
    # the fitted preset serves (a user's trace becomes a benchmark workload)
    served = Engine(EngineConfig(model=f"synthetic:qwen3-moe-mini?layers=2&routing=file:{preset}", device="cpu",
                                 dtype="float32", moe_backend="offload", moe_cache_rate=0.3))
    served.start()
    served.wait_ready(120)
    try:
        tokens, last = asyncio.run(generate(served, "fit", prompt_of(10, seed=9), 5))
        assert len(tokens) == 5
    finally:
        served.shutdown()


def test_the_simulator_replays_an_engine_trace_and_a_preset(tmp_path, capsys):
    engine = serve(tmp_path)
    try:
        asyncio.run(generate(engine, "one", prompt_of(16, seed=3), 24))
    finally:
        engine.shutdown()
    [path] = tmp_path.glob("routing-*.trace")
    assert sim_main(["--trace", str(path), "--cache-rate", "0.3,0.5", "--fetch-fraction", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("lfu") >= 2 and "30%" in out and "50%" in out
    preset = routing_workloads.from_preset("synthetic:qwen3-moe-mini?layers=2&routing=flat", 32, 8, 1)
    assert len(preset["calls"]) == 2 * (1 + 32) and all(len(c) == 1 + 8 for c in preset["calls"][2:])


def test_a_full_trace_stops_whole_and_a_corrupt_one_is_named(tmp_path):
    engine = serve(tmp_path, record_routing_max_gb=1e-6)  # 1 kB: the header, the prompt and ~17 decode steps
    try:
        asyncio.run(generate(engine, "long", prompt_of(16, seed=4), 30))
    finally:
        engine.shutdown()
    [path] = tmp_path.glob("routing-*.trace")
    assert path.stat().st_size <= 1000
    steps = read_trace(path).steps
    assert 0 < len(steps) < 30  # recording stopped, and what was written reads back whole
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match="truncated or corrupt"):
        read_trace(path)

"""benchmarks/sim_expert_cache.py: its replay of the engine's policies (lru + lowest-id, lfu + most-used)
reproduces a real offload and hybrid backend's hit and miss counters call for call; lfu and most-used do what they say on a
trace made by hand; the CLI traces, keeps and replays a trace and names bad arguments."""

from __future__ import annotations

import json

import pytest

from benchmarks.sim_expert_cache import SlotCache, main, record_trace
from kernels.ensure_experts_ref import USE_CAP
from services.engine.config import EngineConfig
from services.engine.models.registry import load_model

MODEL = "synthetic:qwen3-moe-mini?layers=2"  # E = 128, top-8: misses on every call at a 30 % cache


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfu-aging"])
@pytest.mark.parametrize("backend, max_fetch", [("offload", -1), ("hybrid", 2)])
def test_replay_reproduces_the_engines_counters(backend, max_fetch, policy):
    """The replay of the engine's policy (lru: lru + lowest-id; lfu: lfu + most-used) gives its counters;
    lfu-aging: with --moe-cache-lfu-cap 4, so that counts halve (every layer's) many times within the trace."""
    aging = policy == "lfu-aging"
    policy, cap = ("lfu", 4) if aging else (policy, USE_CAP)
    extra = {"moe_hybrid_max_fetch": max_fetch} if backend == "hybrid" else {}
    lm = load_model(EngineConfig(model=MODEL, device="cpu", dtype="float32", moe_backend=backend, moe_cache_rate=0.3,
                                 moe_cache_policy=policy, moe_cache_lfu_cap=cap, max_seq_len=64, **extra))
    try:
        calls = record_trace(lm, 24, 16)  # the prefill (16 x 8 routes: the offload path) and 24 decode steps
        stats = lm.model.backend.stats()
        counters = stats.get("cache", stats)
        sim = SlotCache(len(lm.banks.layers), lm.banks.layers[0].num_experts, lm.model.backend.cache.state.num_slots,
                        max_fetch=max_fetch, evict=policy, fetch="most-used" if policy == "lfu" else "lowest-id",
                        use_cap=cap)
        for layer, *routes in calls:
            sim.call(layer, routes)
        assert len(calls) == 2 * 25
        assert (sim.hits, sim.misses) == (counters["hits"], counters["misses"])
        assert sim.uses.tolist() == lm.model.backend.cache.state.uses.tolist()
        # one use per expert present in a call, as many as hits + misses, until a halving takes some away
        assert (sim.uses.sum() < sim.hits + sim.misses) if aging else (sim.uses.sum() == sim.hits + sim.misses)
        assert counters["misses"] > counters["hits"] > 0  # the cache both hit and missed
    finally:
        close = getattr(lm.model.backend, "close", None)
        if close is not None:
            close()


def test_lfu_keeps_the_expert_used_most_and_most_used_fetches_it():
    """Two slots, one layer: expert 0 is used three times, then 1 and 2 arrive. lru evicts 0 (the least
    recent); lfu evicts 1 (used once), so 0 hits again. A hybrid call that can fetch one of two misses takes
    the lower id (lowest-id) or the one routed to more often before (most-used)."""
    def run(evict):
        cache = SlotCache(1, 4, 2, evict=evict)
        for routes in ([0], [0], [0], [1], [2], [0]):
            cache.call(0, routes)
        return cache.hits

    assert run("lru") == 2 and run("lfu") == 3  # lru: 0 twice; lfu: 0 three times
    for fetch, kept in (("lowest-id", 0), ("most-used", 3)):
        cache = SlotCache(1, 4, 1, max_fetch=1, fetch=fetch)  # one slot, at most one fetch per call
        for routes in ([3], [1], [3], [2], [0, 3]):  # 3 used twice before the last call misses 0 and 3
            cache.call(0, routes)
        assert cache.id_of_slot.tolist() == [kept]


def test_belady_evicts_the_expert_needed_last():
    """Two slots hold 0 and 1; 2 arrives; 1 is routed to again before 0: belady evicts 0 where lru evicts 1
    (the older), so the next call's 1 hits under belady only."""
    from benchmarks.sim_expert_cache import next_uses

    calls = [[0, 1], [0, 0], [0, 2], [0, 1], [0, 0]]  # layer 0: 1, 0, 2, then 1 and 0 again
    for evict, hits in (("lru", 0), ("belady", 1)):
        cache = SlotCache(1, 4, 2, evict=evict)
        for (layer, *routes), ahead in zip(calls, next_uses(calls)):
            cache.call(layer, routes, ahead if evict == "belady" else None)
        assert cache.hits == hits, evict


def test_cli_traces_keeps_and_replays(tmp_path, capsys):
    trace, out = tmp_path / "trace.json", tmp_path / "rows.json"
    args = ["--model", MODEL, "--tokens", "12", "--prompt-len", "8", "--warmup", "4", "--fetch-fraction", "1,0.3"]
    assert main(args + ["--trace-out", str(trace), "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["fetch_fraction"], r["evict"], r["fetch"]) for r in rows] == [
        (1.0, "lru", "lowest-id"), (1.0, "lfu", "lowest-id"), (1.0, "belady", "lowest-id"),
        (0.3, "lru", "lowest-id"), (0.3, "lru", "most-used"), (0.3, "lfu", "lowest-id"), (0.3, "lfu", "most-used"),
        (0.3, "belady", "lowest-id")]
    assert all(0 < r["miss_rate"] <= 1 for r in rows)
    by = {(r["fetch_fraction"], r["evict"], r["fetch"]): r["miss_rate"] for r in rows}
    assert by[(1.0, "belady", "lowest-id")] <= min(by[(1.0, "lru", "lowest-id")], by[(1.0, "lfu", "lowest-id")])
    assert "lfu" in capsys.readouterr().out
    assert main(["--trace", str(trace), "--warmup", "4", "--fetch-fraction", "1,0.3", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["rows"] == rows  # the kept trace replays to the same numbers


def test_requests_share_one_cache_and_the_last_is_measured(tmp_path):
    """--requests 2 traces two prompts back to back. The replay carries the cache from the first request
    into the second and measures only the second's decode: experts the first left behind are its hits."""
    from benchmarks.sim_expert_cache import replay

    out = tmp_path / "two.json"
    assert main(["--model", MODEL, "--tokens", "6", "--prompt-len", "8", "--warmup", "0", "--requests", "2",
                 "--trace-out", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert trace["requests"] == 2 and trace["last_request_start"] == len(trace["calls"]) // 2 == 2 * 7
    # by hand, one layer of 4 experts, 3 slots: request A routes to 0 and 1, request B to 2, then 0 and 1
    a = [[0, 0, 1], [0, 0]]
    b = [[0, 2], [0, 0], [0, 1]]
    both = {"layers": 1, "experts": 4, "prefill_calls": 1, "last_request_start": 2, "calls": a + b}
    alone = {**both, "last_request_start": 0, "calls": b}
    assert replay(both, 0.75, 1.0, "lru", "lowest-id", warmup=0)["miss_rate"] == 0.0  # 0 and 1 still cached
    assert replay(alone, 0.75, 1.0, "lru", "lowest-id", warmup=0)["miss_rate"] == 1.0


@pytest.mark.parametrize("args, named", [(["--fetch-fraction", "x"], "--fetch-fraction"),
                                         (["--fetch-fraction", "2"], "--fetch-fraction"),
                                         (["--tokens", "4", "--warmup", "4"], "--warmup"),
                                         (["--requests", "0"], "--requests")])
def test_bad_arguments_are_named(args, named, capsys):
    with pytest.raises(SystemExit):
        main(["--model", MODEL, "--prompt-len", "4"] + args)
    assert named in capsys.readouterr().err

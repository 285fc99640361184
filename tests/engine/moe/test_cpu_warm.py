"""--moe-cpu-warm: the executor reads the next layer's predicted CPU experts between jobs and the split keeps
them for the CPU. Greedy tokens stay resident's; on a model routed like Qwen3-30B-A3B the CPU's experts are
the warmed ones; the reasons it is off; the GPU path inside the runner's captured decode graph."""

import os

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logging  # noqa: E402

import pytest  # noqa: E402

from services.engine.config import EngineConfig, MoEBackend  # noqa: E402
from services.engine.models.registry import build_backend, load_model  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.hybrid import HybridBackend  # noqa: E402
from services.engine.reports import flat_backend_stats  # noqa: E402
from tests.helpers import graph_greedy, greedy_generate, on_cuda_with_resident_tokens, tokens_against_resident  # noqa: E402

PROMPT = [(7 * i + 3) % 120 + 4 for i in range(40)]
NEW_TOKENS = 8


@pytest.mark.parametrize("kind", [MoEBackend.CPU, MoEBackend.HYBRID])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_greedy_equals_resident_with_warm(arch, kind, hf_checkpoints, loaded):
    lm = loaded[arch]
    with tokens_against_resident(lm, str(hf_checkpoints[arch].dir), PROMPT, NEW_TOKENS, moe_backend=kind.value,
                                 moe_cache_size=lm.spec.top_k, moe_cpu_warm=2) as (want, got, backend):
        assert got == want
        warm = backend.stats()["cpu_warm"]
        assert warm["per_token"] == 2 and warm["warms"] > 0 and warm["experts"] >= warm["warms"]
        assert warm["bytes"] == warm["experts"] * backend.expert_bytes  # whole experts, each read once
        assert flat_backend_stats(backend.stats())["cpu_warmed"] == warm["experts"]  # tandem_expert_cpu_warmed_total


def test_warm_with_prefetch_keeps_the_tokens(hf_checkpoints, loaded):
    """Both ways of reading the next layer ahead at once (the stack's e2e test serves with both)."""
    lm = loaded["qwen3_moe"]
    with tokens_against_resident(lm, str(hf_checkpoints["qwen3_moe"].dir), PROMPT, NEW_TOKENS, moe_backend="hybrid",
                                 moe_cache_size=2 * lm.spec.top_k + 1, moe_prefetch=1,
                                 moe_cpu_warm=2) as (want, got, backend):
        assert got == want
        stats = backend.stats()
        assert stats["prefetch"]["prefetched"] > 0 and stats["cpu_warm"]["experts"] > 0


@pytest.fixture(scope="module")
def mini():
    return load_model(EngineConfig(model="synthetic:qwen3-moe-mini"), attach_backend=False)


def split_against_plan(mini, warm: int, policy: str) -> tuple[int, int, list[int]]:
    """Hybrid on qwen3-moe-mini (a third cached, at most 2 misses fetched per layer), decode layers after the
    first: (layers, layers where the CPU got as many of the planned misses as it could, i.e. min(planned
    misses, its share)), and the tokens. ``warm`` 0: the same plan, hidden from the split."""
    cfg = EngineConfig(model=mini.model_id, moe_backend="hybrid", moe_cache_rate=0.34, moe_hybrid_max_fetch=2,
                       moe_cpu_warm=max(warm, 1), moe_cache_policy=policy)
    backend = build_backend(mini, cfg)
    E = backend.cache.state.num_experts
    seen = {"layers": 0, "as_planned": 0}
    ensure = backend._ensure

    def spy(layer, topk_ids):
        planned = set(backend.warm.row(layer).tolist()) - {-1}
        cached = backend.cache.state.slot_of_id[layer * E:(layer + 1) * E]
        misses = {e for e in set(topk_ids.flatten().tolist()) - {-1} if cached[e] < 0}
        if not warm:
            backend.warm.rows[layer].fill_(-1)
        slot_ids, cpu_ids = ensure(layer, topk_ids)
        if layer and topk_ids.shape[0] == 1:  # decode steps
            cpu = set(cpu_ids.flatten().tolist()) - {-1}
            seen["layers"] += 1
            seen["as_planned"] += len(cpu & planned) == min(len(planned & misses), len(cpu))
        return slot_ids, cpu_ids

    backend._ensure = spy
    mini.model.set_backend(backend)
    try:
        tokens = greedy_generate(mini, PROMPT, 16)
        assert backend.stats()["cpu_warm"]["experts"] > 0
    finally:
        backend.close()
    return seen["layers"], seen["as_planned"], tokens


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_cpu_computes_the_warmed_experts(mini, policy):
    """qwen3-moe-mini routes like Qwen3-30B-A3B (E 128, top-8): with the 3 likeliest uncached experts per
    token warmed, every layer's CPU share holds as many of them as it can (the fetch takes the others
    first), under either fetch order. Without the preference, lru's lowest-id rule picks the CPU's share
    regardless of the plan. Tokens unchanged."""
    layers, as_planned, tokens = split_against_plan(mini, 3, policy)
    blind_layers, blind_as_planned, blind_tokens = split_against_plan(mini, 0, policy)
    assert tokens == blind_tokens
    assert layers == blind_layers > 20 and as_planned == layers
    if policy == "lru":
        assert blind_as_planned < 0.8 * layers, (blind_as_planned, layers)


def test_warm_off_and_why(hf_checkpoints, loaded, caplog):
    lm = loaded["qwen3_moe"]
    d, A = str(hf_checkpoints["qwen3_moe"].dir), lm.spec.top_k
    cfg = EngineConfig(model=d, moe_backend="hybrid", moe_cache_size=2 * A, moe_cpu_warm=1)
    with caplog.at_level(logging.WARNING):  # a context without the model's routers (e.g. a bench's own)
        blind = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, A, 0))
    try:
        assert blind.warm is None and blind.stats()["cpu_warm"] is None and "without the model's routers" in caplog.text
    finally:
        blind.close()
    clamped = build_backend(lm, EngineConfig(model=d, moe_backend="cpu", moe_cache_size=2 * A, moe_cpu_warm=99))
    try:
        assert clamped.warm.per_token == A
    finally:
        clamped.close()
    with pytest.raises(ValueError, match="--moe-cpu-warm"):
        EngineConfig(model=d, moe_cpu_warm=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [MoEBackend.CPU, MoEBackend.HYBRID])
def test_cuda_graph_decode_with_warm_equals_resident(kind, hf_checkpoints):
    """The real data path: the plan (predictor, Triton pick, post to the pinned warm table) inside the
    runner's captured decode graph, the executor warming between the jobs it serves; greedy tokens ==
    resident's, and the executor did warm."""
    d = str(hf_checkpoints["qwen3_moe"].dir)
    lm, want = on_cuda_with_resident_tokens(d, PROMPT, NEW_TOKENS)
    A = lm.spec.top_k
    backend = build_backend(lm, EngineConfig(model=d, device="cuda", moe_backend=kind.value, moe_cache_size=2 * A,
                                             moe_cpu_warm=2))
    lm.model.set_backend(backend)
    try:
        assert graph_greedy(lm, kind.value, PROMPT, NEW_TOKENS) == want
        warm = backend.stats()["cpu_warm"]
        assert warm["warms"] > 0 and warm["experts"] > 0, warm
        assert backend.handoff.poll_stats()["error"] == ""
    finally:
        backend.close()

"""Next-layer prefetch (--moe-prefetch): the predictor is the next router on this layer's MoE input, the
backends keep giving resident's greedy tokens with it on, a synthetic model's misses drop by what was
prefetched, no slot in use is ever evicted at the smallest cache it runs with, and the reasons it is off."""

import os

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logging  # noqa: E402

import pytest  # noqa: E402

from services.engine.config import EngineConfig, MoEBackend  # noqa: E402
from services.engine.models.causal_lm import MoECausalLM  # noqa: E402
from services.engine.models.registry import build_backend, load_model  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.cache import ExpertCache  # noqa: E402
from services.engine.moe.layer import MoEBlock  # noqa: E402
from services.engine.moe.offload import OffloadBackend  # noqa: E402
from services.engine.moe.prefetch import NextLayerPrefetch, next_layer_predictors  # noqa: E402
from services.engine.reports import flat_backend_stats  # noqa: E402
from tests.helpers import graph_greedy, greedy_generate, on_cuda_with_resident_tokens, tokens_against_resident  # noqa: E402

PROMPT = [(7 * i + 3) % 120 + 4 for i in range(40)]
NEW_TOKENS = 8


def test_predictor_is_the_next_router_on_the_same_stream(hf_checkpoints, loaded):
    """With the stream unchanged between two MoE layers (r' = r), the predictor applied to this layer's
    normed input gives exactly the next router's logits; a zero norm weight is not a division by zero.
    qwen2_moe has a dense layer between its MoE layers."""
    for arch in ("qwen3_moe", "qwen2_moe"):
        lm = MoECausalLM(loaded[arch].spec)
        moe_layers = [layer for layer in lm.model.layers if isinstance(layer.ffn, MoEBlock)]
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for layer in moe_layers:
                layer.post_attention_layernorm.weight.copy_(torch.randn(lm.spec.hidden_size, generator=g))
            moe_layers[0].post_attention_layernorm.weight[3] = 0.0
        predictors = next_layer_predictors(lm)
        assert len(predictors) == len(moe_layers) - 1
        r = torch.randn(5, lm.spec.hidden_size, generator=g)
        with torch.no_grad():
            for l, pred in enumerate(predictors):
                here, nxt = moe_layers[l], moe_layers[l + 1]
                got = torch.nn.functional.linear(here.post_attention_layernorm(r), pred)  # [T, E]
                keep = torch.ones(lm.spec.hidden_size)
                if l == 0:  # component 3 is lost in this layer's input: the predictor can only leave it out
                    keep[3] = 0.0
                want = nxt.ffn.gate(nxt.post_attention_layernorm(r) * keep)
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", [MoEBackend.OFFLOAD, MoEBackend.HYBRID])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss"])  # gpt_oss: MXFP4 + bias banks copied ahead
def test_greedy_equals_resident_with_prefetch(arch, kind, hf_checkpoints, loaded):
    lm = loaded[arch]
    with tokens_against_resident(lm, str(hf_checkpoints[arch].dir), PROMPT, NEW_TOKENS, moe_backend=kind.value,
                                 moe_cache_size=2 * lm.spec.top_k + 2, moe_prefetch=2) as (want, got, backend):
        assert got == want
        stats = backend.stats()
        assert stats["prefetch"]["per_token"] == 2 and stats["prefetch"]["prefetched"] > 0
        assert stats["prefetch"]["bytes_prefetched"] == stats["prefetch"]["prefetched"] * stats["cache"]["expert_bytes"]
        assert flat_backend_stats(stats)["prefetched"] == stats["prefetch"]["prefetched"]  # the engine's stats


@pytest.fixture(scope="module")
def mini():
    return load_model(EngineConfig(model="synthetic:qwen3-moe-mini"), attach_backend=False)


@pytest.mark.parametrize("kind", [MoEBackend.OFFLOAD, MoEBackend.HYBRID])
def test_prefetched_experts_become_hits(kind, mini):
    """qwen3-moe-mini routes like Qwen3-30B-A3B (E 128, top-8): with a third of the experts cached, every
    expert copied ahead saves (almost) one miss of the next layer, and the tokens do not change."""
    runs = {}
    for per_token in (0, 2, 8):
        cfg = EngineConfig(model=mini.model_id, moe_backend=kind.value, moe_cache_rate=0.34, moe_prefetch=per_token)
        backend = build_backend(mini, cfg)
        mini.model.set_backend(backend)
        try:
            tokens = greedy_generate(mini, PROMPT, 24)
            s = backend.stats()
        finally:
            getattr(backend, "close", lambda: None)()
        runs[per_token] = tokens, s["cache"]["misses"], (s["prefetch"] or {}).get("prefetched", 0)
    base_tokens, base_misses, _ = runs[0]
    for per_token in (2, 8):
        tokens, misses, prefetched = runs[per_token]
        assert tokens == base_tokens
        assert prefetched >= 20 * per_token  # ~one copy per token, layer but the last and unit of P
        assert base_misses - misses >= 0.8 * prefetched, (per_token, base_misses, misses, prefetched)


def test_no_slot_in_use_is_evicted_at_the_smallest_cache(loaded):
    """At S = T*(2A + P) (the least ``fits`` allows), random routing, layer after layer: the reserve for
    layer l+1 never takes a slot of layer l's routes (the GPU may still be reading them), and ensure(l+1)
    never takes a slot reserved for it (the side stream may still be writing it)."""
    lm = loaded["qwen3_moe"]
    L, E, A, P, T = len(lm.banks.layers), lm.spec.num_experts, lm.spec.top_k, 2, 2
    cache = ExpertCache(lm.banks, T * (2 * A + P), torch.device("cpu"), use_triton=False)
    prefetch = NextLayerPrefetch(cache, [torch.randn(E, lm.spec.hidden_size) for _ in range(L - 1)], P, A)
    assert prefetch.fits(T) and not NextLayerPrefetch(
        ExpertCache(lm.banks, T * (2 * A + P) - 1, torch.device("cpu"), use_triton=False),
        prefetch.predictors, P, A).fits(T)
    s, ps = cache.state, prefetch.state
    g = torch.Generator().manual_seed(1)
    for step in range(60):
        for layer in range(L):
            reserved = {}  # slot -> flat id reserved for this layer by the previous layer's issue
            if layer:
                reserved = {x: int(s.id_of_slot[x]) for x in ps.job_dst[: int(ps.job_count[0])].tolist()}
            ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A]
            slot_ids = cache.ensure(layer, ids)
            assert {x: int(s.id_of_slot[x]) for x in reserved} == reserved, (step, layer)
            in_use = {x: int(s.id_of_slot[x]) for x in slot_ids.flatten().tolist()}
            assert all(flat // E == layer for flat in in_use.values())
            prefetch.issue(layer, torch.randn(T, lm.spec.hidden_size, generator=g))
            assert {x: int(s.id_of_slot[x]) for x in in_use} == in_use, (step, layer)
    assert int(ps.fetched.sum()) > 0


def test_prefetch_off_and_why(hf_checkpoints, loaded, caplog):
    lm = loaded["qwen3_moe"]
    d, A = str(hf_checkpoints["qwen3_moe"].dir), lm.spec.top_k
    with caplog.at_level(logging.WARNING):
        small = build_backend(lm, EngineConfig(model=d, moe_backend="offload", moe_cache_size=A, moe_prefetch=1))
    assert small.prefetch is None and "too small to prefetch" in caplog.text
    cfg = EngineConfig(model=d, moe_backend="offload", moe_cache_size=4 * A, moe_prefetch=1)
    caplog.clear()
    with caplog.at_level(logging.WARNING):  # a context without the model's routers (e.g. a bench's own)
        blind = OffloadBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, A, 0))
    assert blind.prefetch is None and "without the model's routers" in caplog.text
    assert build_backend(lm, EngineConfig(model=d, moe_backend="offload", moe_cache_size=4 * A)).stats()["prefetch"] is None
    clamped = build_backend(lm, EngineConfig(model=d, moe_backend="offload", moe_cache_size=4 * A, moe_prefetch=99))
    assert clamped.prefetch.per_token == A
    cpu = build_backend(lm, EngineConfig(model=d, moe_backend="cpu", moe_cache_size=4 * A, moe_prefetch=1))
    try:  # the cpu backend fetches nothing while decoding, ahead or not
        assert cpu.offload.prefetch is None and cpu.stats()["prefetch"] is None
    finally:
        cpu.close()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", [MoEBackend.OFFLOAD, MoEBackend.HYBRID])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])  # gpt_oss: the fused copy of MXFP4 and bias banks
def test_cuda_graph_decode_with_prefetch_equals_resident(kind, arch, hf_checkpoints):
    """The real data path: the side stream forked and joined inside the runner's captured decode graph,
    Triton pick/ensure, the fused copy from pinned banks; replayed greedy tokens == resident's."""
    d = str(hf_checkpoints[arch].dir)
    lm, want = on_cuda_with_resident_tokens(d, PROMPT, NEW_TOKENS)
    A = lm.spec.top_k
    backend = build_backend(lm, EngineConfig(model=d, device="cuda", moe_backend=kind.value, moe_cache_size=2 * A + 2,
                                             moe_prefetch=2))
    lm.model.set_backend(backend)
    try:
        assert graph_greedy(lm, kind.value, PROMPT, NEW_TOKENS) == want
        assert backend.stats()["prefetch"]["prefetched"] > 0
    finally:
        getattr(backend, "close", lambda: None)()

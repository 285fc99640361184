"""The `offload` backend: same greedy tokens as `resident` for every architecture and cache size, prompts
whose experts exceed the cache, hit/miss statistics counted independently, and cache sizing."""

import os
import math

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.engine.config import EngineConfig  # noqa: E402
from services.engine.models.registry import build_backend, load_model  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.offload import OffloadBackend  # noqa: E402
from services.engine.moe.sizing import GiB, CacheGeometry, decide_cache_size  # noqa: E402
from tests.helpers import CPU_PLAYS_THE_DEVICE, greedy_generate, resident_greedy  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]
PROMPT = [(7 * i + 3) % 120 + 4 for i in range(40)]  # 40 tokens: a prefill touching every expert
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def resident_tokens(hf_checkpoints, loaded):
    return {name: t["long"] for name, t in resident_greedy(loaded, hf_checkpoints, {"long": PROMPT}, NEW_TOKENS).items()}


class RouteCounter:
    """Pass-through wrapper that counts, independently of the cache, the unique experts of every
    (layer, step) and the distinct (layer, expert) pairs ever routed."""

    def __init__(self, inner):
        self.inner, self.unique, self.pairs = inner, 0, set()

    def forward(self, layer, hidden, topk_ids, topk_weights):
        experts = set(topk_ids.flatten().tolist()) - {-1}
        self.unique += len(experts)
        self.pairs |= {(layer, e) for e in experts}
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)

    def stats(self):
        return self.inner.stats()


def sizes(lm) -> dict[str, int]:
    L, E, A = len(lm.banks.layers), lm.spec.num_experts, lm.spec.top_k
    return {"minimum": A, "E": E, "LE/3": math.ceil(L * E / 3)}


def run_offload(lm, hf_dir, slots, use_triton=None, prompt=PROMPT, n=NEW_TOKENS, policy="lru"):
    cfg = EngineConfig(model=str(hf_dir), moe_backend="offload", moe_cache_policy=policy)
    backend = OffloadBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0), num_slots=slots,
                             use_triton=use_triton)
    counter = RouteCounter(backend)
    lm.model.set_backend(counter)
    return greedy_generate(lm, prompt, n), backend, counter


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("size", ["minimum", "E", "LE/3"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offload_greedy_equals_resident(arch, size, policy, hf_checkpoints, loaded, resident_tokens):
    lm = loaded[arch]
    slots = sizes(lm)[size]
    tokens, backend, counter = run_offload(lm, hf_checkpoints[arch].dir, slots, policy=policy)
    assert backend.cache.lfu == (policy == "lfu") and backend.stats()["cache"]["policy"] == policy
    assert tokens == resident_tokens[arch]
    s = backend.stats()["cache"]
    assert s["hits"] + s["misses"] == counter.unique
    assert s["fetched"] == s["misses"] and s["bytes_fetched"] == s["misses"] * lm.banks.expert_nbytes()
    assert sum(s["per_layer"]["misses"]) == s["misses"] and len(s["per_layer"]["hits"]) == len(lm.banks.layers)
    if size == "minimum":  # the prefill's unique experts exceed the cache: it ran in chunks
        assert backend.cache.num_chunks(len(PROMPT) * lm.spec.top_k) > 1


def test_cache_holding_everything_misses_each_expert_once(hf_checkpoints, loaded, resident_tokens):
    lm = loaded["qwen3_moe"]
    L, E = len(lm.banks.layers), lm.spec.num_experts
    tokens, backend, counter = run_offload(lm, hf_checkpoints["qwen3_moe"].dir, L * E)
    assert tokens == resident_tokens["qwen3_moe"]
    assert backend.stats()["cache"]["misses"] == len(counter.pairs)  # cold misses only, no eviction


@CPU_PLAYS_THE_DEVICE
def test_offload_with_triton_kernels(hf_checkpoints, loaded, resident_tokens):
    """The Triton ensure + fused copy inside the layer (interpreted without a GPU), smallest cache."""
    lm = loaded["mixtral"]
    tokens, backend, counter = run_offload(lm, hf_checkpoints["mixtral"].dir, lm.spec.top_k, use_triton=True)
    assert tokens == resident_tokens["mixtral"]
    s = backend.stats()["cache"]
    assert s["hits"] + s["misses"] == counter.unique


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_offload_sweep_sizes_and_long_generation(arch, hf_checkpoints, loaded):
    lm = loaded[arch]
    L, E, A = len(lm.banks.layers), lm.spec.num_experts, lm.spec.top_k
    lm.model.set_backend(build_backend(lm, EngineConfig(model=str(hf_checkpoints[arch].dir))))
    want = greedy_generate(lm, PROMPT * 3, 32)
    for slots in sorted({A, A + 1, E - 1, E, E + 1, L * E // 2, L * E}):
        tokens, backend, counter = run_offload(lm, hf_checkpoints[arch].dir, slots, prompt=PROMPT * 3, n=32)
        assert tokens == want, f"{slots} slots"
        s = backend.stats()["cache"]
        assert s["hits"] + s["misses"] == counter.unique


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offload_on_cuda_equals_resident(arch, policy, hf_checkpoints):
    """Triton ensure + fused copy from pinned banks, fp32 on the GPU, every cache size."""
    from services.engine.models.registry import pin_banks

    cfg = EngineConfig(model=str(hf_checkpoints[arch].dir), device="cuda")
    lm = load_model(cfg, attach_backend=False)
    lm.model.set_backend(build_backend(lm, cfg))
    want = greedy_generate(lm, PROMPT, NEW_TOKENS)
    pin_banks(lm.banks)
    for size, slots in sizes(lm).items():
        tokens, backend, counter = run_offload(lm, hf_checkpoints[arch].dir, slots, policy=policy)
        assert backend.cache.use_triton
        assert tokens == want, size
        s = backend.stats()["cache"]
        assert s["hits"] + s["misses"] == counter.unique


# ---- sizing ---------------------------------------------------------------------------------------------

def sizing_config(**flags) -> EngineConfig:
    return EngineConfig(model="sizing-test", **flags)


GEOM = CacheGeometry(num_layers=4, num_experts=16, top_k=4, expert_nbytes=1 << 20)  # 1 MiB experts


def test_sizing_flags():
    cpu = torch.device("cpu")
    assert decide_cache_size(sizing_config(moe_cache_size=10), GEOM, cpu).slots == 10
    assert decide_cache_size(sizing_config(moe_cache_rate=0.3), GEOM, cpu).slots == math.ceil(0.3 * 64)
    assert decide_cache_size(sizing_config(moe_cache_size=1000), GEOM, cpu).slots == 64  # capped at L*E
    d = decide_cache_size(sizing_config(moe_cache_auto=True), GEOM, cpu)
    assert d.slots == 64 and d.share == 1.0  # CPU device, no limit: every expert
    # CPU device with a limit: (limit - weights) // expert bytes
    d = decide_cache_size(sizing_config(moe_cache_auto=True, gpu_memory_limit=40 / 1024), GEOM, cpu,
                          weight_bytes=8 << 20, kv_reserve_bytes=2 << 20)
    assert d.slots == 40 - 8 - 2 and d.nbytes == 30 << 20


def test_auto_on_cuda_budget_is_min_of_free_and_limit():
    cuda = torch.device("cuda")  # free_bytes given: no CUDA call, the formula alone
    cfg = sizing_config(moe_cache_auto=True, gpu_memory_limit=24)
    geom = CacheGeometry(48, 128, 8, 9_437_184)  # Qwen3-30B-A3B experts, 9.4 MB
    d = decide_cache_size(cfg, geom, cuda, weight_bytes=3 * GiB, kv_reserve_bytes=2 * GiB, free_bytes=130 * GiB)
    budget = 21 * GiB
    assert d.slots == (budget - 2 * GiB - int(0.05 * budget)) // geom.expert_nbytes
    d2 = decide_cache_size(cfg, geom, cuda, weight_bytes=3 * GiB, kv_reserve_bytes=2 * GiB, free_bytes=10 * GiB)
    assert d2.slots == (10 * GiB - 2 * GiB - (512 << 20)) // geom.expert_nbytes  # free VRAM is smaller


def test_sizing_below_minimum_names_it():
    with pytest.raises(ValueError, match="minimum of 4 slots"):
        decide_cache_size(sizing_config(moe_cache_size=3), GEOM, torch.device("cpu"))
    with pytest.raises(ValueError, match="--moe-cache-rate 0.01.*minimum of 4 slots"):
        decide_cache_size(sizing_config(moe_cache_rate=0.01), GEOM, torch.device("cpu"))
    with pytest.raises(ValueError, match="--moe-cache-auto --gpu-memory-limit.*minimum"):
        decide_cache_size(sizing_config(moe_cache_auto=True, gpu_memory_limit=0.001), GEOM, torch.device("cpu"))
    with pytest.raises(ValueError, match="mutually exclusive"):
        sizing_config(moe_cache_size=4, moe_cache_auto=True)


def test_offload_backend_from_config(hf_checkpoints, loaded):
    lm = loaded["olmoe"]
    cfg = EngineConfig(model=str(hf_checkpoints["olmoe"].dir), moe_backend="offload", moe_cache_rate=0.5)
    backend = build_backend(lm, cfg)
    assert isinstance(backend, OffloadBackend)
    assert backend.cache.num_slots == math.ceil(0.5 * len(lm.banks.layers) * lm.spec.num_experts)
    with pytest.raises(ValueError, match="minimum of 2 slots"):
        build_backend(lm, EngineConfig(model=str(hf_checkpoints["olmoe"].dir), moe_backend="offload", moe_cache_size=1))


def test_batch_invariant_needs_a_decode_step_in_one_pass(hf_checkpoints, loaded):
    """--batch-invariant: 8 rows x top-2 = 16 routes over 8 experts need 8 slots to run as one chunk; with
    fewer, which chunk a route falls in would depend on the other rows' experts: refused at start."""
    lm = loaded["qwen3_moe"]
    cfg = EngineConfig(model=str(hf_checkpoints["qwen3_moe"].dir), moe_backend="offload", batch_invariant=True,
                       max_running_requests=8)
    ctx = BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0)
    with pytest.raises(ValueError, match="--batch-invariant: a decode step's 16 routes need 2 passes"):
        OffloadBackend(ctx, num_slots=4)
    assert OffloadBackend(ctx, num_slots=8).cache.num_chunks(16) == 1

"""The peer tier (--moe-peer-devices, docs/multi-gpu.md): with a simulated peer (a second slot pool on the
same device: the CPU here, cuda:0 on one GPU) or a real second GPU, `offload` and `hybrid` give the same
greedy tokens as `resident` (fp32); misses the peer holds are copied from it (shown with the host banks
zeroed); placement refreshes keep the table and the peer slots consistent; bad flags are refused."""

import os

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.engine.config import EngineConfig, MoEBackend  # noqa: E402
from services.engine.models.registry import pin_banks  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.hybrid import HybridBackend  # noqa: E402
from services.engine.moe.offload import OffloadBackend  # noqa: E402
from services.engine.moe.peer_cache import GiB, parse_peer_devices, peer_slots  # noqa: E402
from services.engine.moe.peer_split import PeerSplitController  # noqa: E402
from tests.helpers import (CPU_PLAYS_THE_DEVICE, graph_greedy, greedy_generate, on_cuda_with_resident_tokens,  # noqa: E402
                           resident_greedy)

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]
PROMPT = [(7 * i + 3) % 120 + 4 for i in range(40)]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def resident_tokens(hf_checkpoints, loaded):
    return {name: t["p"] for name, t in resident_greedy(loaded, hf_checkpoints, {"p": PROMPT}, NEW_TOKENS).items()}


class Counter:
    """Pass-through: the unique experts of every (layer, step), counted apart from the cache."""

    def __init__(self, inner):
        self.inner, self.unique = inner, 0

    def forward(self, layer, hidden, topk_ids, topk_weights):
        self.unique += len(set(topk_ids.flatten().tolist()) - {-1})
        return self.inner.forward(layer, hidden, topk_ids, topk_weights)

    def stats(self):
        return self.inner.stats()


def peer_gib(lm, experts: int) -> float:
    """--moe-peer-memory for ``experts`` slots on each peer."""
    return (experts + 0.5) * lm.banks.expert_nbytes() / GiB


def build(lm, hf_dir, kind: MoEBackend, slots: int, peer_memory: float | None, device: str = "cpu",
          peers: str = "cpu", use_triton=None, graph_mode: bool = False, policy: str = "lfu"):
    cfg = EngineConfig(model=str(hf_dir), device=device, moe_backend=kind.value, moe_peer_devices=peers,
                       moe_peer_memory=peer_memory, moe_cache_policy=policy)
    ctx = BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0)
    if kind is MoEBackend.OFFLOAD:
        return OffloadBackend(ctx, num_slots=slots, use_triton=use_triton)
    return HybridBackend(ctx, kind, num_slots=slots, use_triton=use_triton, count_routes=True, graph_mode=graph_mode)


def check_counts(stats: dict, counter: Counter, fetches: bool = True) -> None:
    """Lookups counted apart; fetched = from the peer + from the host; with ``fetches`` some from the peer."""
    s = stats["cache"]
    assert s["hits"] + s["misses"] == counter.unique
    assert s["peer_fetched"] + s["host_fetched"] == s["fetched"] and (s["peer_fetched"] > 0 or not fetches)
    assert sum(s["per_layer"]["peer_fetched"]) == s["peer_fetched"]


@pytest.mark.parametrize("peer", ["third", "all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_offload_with_peer_equals_resident(arch, peer, hf_checkpoints, loaded, resident_tokens):
    lm = loaded[arch]
    L, E = len(lm.banks.layers), lm.spec.num_experts
    backend = build(lm, hf_checkpoints[arch].dir, MoEBackend.OFFLOAD, lm.spec.top_k,
                    peer_gib(lm, L * E // 3) if peer == "third" else None)
    tier = backend.cache.peer
    assert tier.num_slots == (L * E // 3 if peer == "third" else L * E) and tier.holds_everything == (peer == "all")
    counter = Counter(backend)
    lm.model.set_backend(counter)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens[arch]
    check_counts(backend.stats(), counter)
    if peer == "all":  # every miss came from the peer
        assert backend.stats()["cache"]["host_fetched"] == 0


def test_misses_held_by_the_peer_are_read_from_it(hf_checkpoints, loaded, resident_tokens):
    """Host banks zeroed after the peer tier is filled: the tokens only come out right if every miss was
    copied from the peer slots."""
    lm = loaded["qwen3_moe"]
    backend = build(lm, hf_checkpoints["qwen3_moe"].dir, MoEBackend.OFFLOAD, lm.spec.top_k, None)
    saved = [{k: v.clone() for k, v in layer.tensors.items()} for layer in lm.banks.layers]
    lm.model.set_backend(backend)
    try:
        for layer in lm.banks.layers:
            for t in layer.tensors.values():
                t.zero_()
        assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens["qwen3_moe"]
    finally:
        for layer, keep in zip(lm.banks.layers, saved):
            for k, v in layer.tensors.items():
                v.copy_(keep[k])


@pytest.mark.parametrize("mode", [MoEBackend.HYBRID, MoEBackend.CPU])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_hybrid_with_peer_equals_resident(arch, mode, hf_checkpoints, loaded, resident_tokens):
    lm = loaded[arch]
    L, E = len(lm.banks.layers), lm.spec.num_experts
    backend = build(lm, hf_checkpoints[arch].dir, mode, lm.spec.top_k, peer_gib(lm, L * E // 2))
    counter = Counter(backend)
    lm.model.set_backend(counter)
    try:
        assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens[arch]
        stats = backend.stats()
        check_counts(stats, counter, fetches=mode is MoEBackend.HYBRID)  # cpu fetches for long prompt chunks only
        if mode is MoEBackend.HYBRID:
            assert isinstance(backend.controller, PeerSplitController)
            assert stats["split"]["peer_share"] == backend.cache.peer.peer_share
        assert backend.routes["cpu"] > 0
    finally:
        backend.close()


@CPU_PLAYS_THE_DEVICE
def test_offload_with_peer_through_the_triton_kernels(hf_checkpoints, loaded, resident_tokens):
    """The fused ensure + two-source copy (interpreted), smallest home cache, a peer holding a third."""
    lm = loaded["mixtral"]
    L, E = len(lm.banks.layers), lm.spec.num_experts
    backend = build(lm, hf_checkpoints["mixtral"].dir, MoEBackend.OFFLOAD, lm.spec.top_k, peer_gib(lm, L * E // 3),
                    use_triton=True)
    counter = Counter(backend)
    lm.model.set_backend(counter)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens["mixtral"]
    check_counts(backend.stats(), counter)


def test_refresh_places_the_most_used_experts_not_at_home(hf_checkpoints, loaded, resident_tokens):
    lm = loaded["qwen3_moe"]
    L, E = len(lm.banks.layers), lm.spec.num_experts
    G = L * E // 4
    backend = build(lm, hf_checkpoints["qwen3_moe"].dir, MoEBackend.OFFLOAD, lm.spec.top_k, peer_gib(lm, G))
    lm.model.set_backend(backend)
    greedy_generate(lm, PROMPT, NEW_TOKENS)
    tier, state = backend.cache.peer, backend.cache.state
    tier.refresh()
    uses = state.uses.tolist()
    at_home = {i for i, s in enumerate(state.slot_of_id.tolist()) if s >= 0}
    held = [f for f in tier.placed if f >= 0]
    assert len(held) == G == len(set(held))
    outside = sorted((f for f in range(L * E) if f not in at_home), key=lambda f: -uses[f])
    if len(outside) >= G:  # the G most used of those the home slots lack (ties: any of the equal counts)
        assert not set(held) & at_home
        assert min(uses[f] for f in held) >= uses[outside[G - 1]]
    table = tier.peer_slot_of_id.tolist()
    for g, f in enumerate(tier.placed):
        assert table[f] == g
        k, p = divmod(g, tier.P)
        for name, bank in tier.banks[k].items():
            assert torch.equal(bank[p], lm.banks.layers[f // E].tensors[name][f % E])
    assert sum(t >= 0 for t in table) == G
    for _ in range(2):  # the engine's refresh hook; tokens stay right after a re-placement
        assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens["qwen3_moe"]
        for _ in range(256):
            backend.observe_decode_step(0.01, 1)
    assert tier.refreshes == 1 + 6  # the one above, then after 16, 32, 64, 128, 256 and 512 steps


def test_flags_are_checked():
    with pytest.raises(ValueError, match="cpu .*peer"):
        EngineConfig(model="x", moe_backend="offload", moe_peer_devices="cuda:1")
    with pytest.raises(ValueError, match="cuda:N"):
        EngineConfig(model="x", device="cuda", moe_backend="offload", moe_peer_devices="cpu")
    with pytest.raises(ValueError, match="resident"):
        EngineConfig(model="x", moe_peer_devices="cpu")
    with pytest.raises(ValueError, match="--moe-peer-memory"):
        EngineConfig(model="x", moe_backend="offload", moe_peer_memory=1.0)
    with pytest.raises(ValueError, match="named twice"):
        parse_peer_devices("cuda:1,cuda:1")
    cfg = EngineConfig(model="x", device="cuda", moe_backend="offload", moe_peer_devices="cuda:0")
    with pytest.raises(ValueError, match="give --moe-peer-memory"):  # a simulated peer on the home GPU
        peer_slots(cfg, torch.device("cuda:0"), torch.device("cuda:0"), 1 << 20)
    cfg = EngineConfig(model="x", moe_backend="offload", moe_peer_devices="cpu", moe_peer_memory=0.5)
    assert peer_slots(cfg, torch.device("cpu"), torch.device("cpu"), 1 << 20)[0] == 512


# ---- CUDA: two pools on cuda:0 (simulated peer), and a real second GPU when there is one ----------------

def cuda_peers() -> list[str]:
    return ["cuda:0"] + (["cuda:1"] if torch.cuda.is_available() and torch.cuda.device_count() > 1 else [])


@pytest.mark.gpu
@pytest.mark.parametrize("peers", cuda_peers())
@pytest.mark.parametrize("kind", [MoEBackend.OFFLOAD, MoEBackend.HYBRID])
def test_cuda_with_peer_equals_resident(kind, peers, hf_checkpoints):
    """Triton ensure + the fused two-source copy from the peer's VRAM and pinned host banks, fp32; eager,
    then offload's decode replayed from a CUDA graph and hybrid's graph handoff."""
    d = str(hf_checkpoints["qwen3_moe"].dir)
    lm, want = on_cuda_with_resident_tokens(d, PROMPT, NEW_TOKENS)
    pin_banks(lm.banks)
    L, E = len(lm.banks.layers), lm.spec.num_experts
    for graphs in (False, True):
        backend = build(lm, d, kind, lm.spec.top_k, peer_gib(lm, L * E // 3), device="cuda", peers=peers,
                        graph_mode=graphs)
        counter = Counter(backend)
        replay = graphs and kind is MoEBackend.OFFLOAD  # the counter's host reads cannot be captured
        lm.model.set_backend(backend if replay else counter)
        try:
            if replay:
                assert graph_greedy(lm, "offload", PROMPT, NEW_TOKENS) == want
            else:
                assert greedy_generate(lm, PROMPT, NEW_TOKENS) == want
            s = backend.stats()["cache"]
            assert s["peer_fetched"] > 0 and s["peer"]["devices"] == [peers]
            assert s["peer"]["p2p_gbps"][peers] > 0
            if not replay:
                check_counts(backend.stats(), counter)
        finally:
            getattr(backend, "close", lambda: None)()


@pytest.mark.gpu
def test_an_absent_peer_gpu_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from services.engine.moe.peer_cache import make_peer_tier

    n = torch.cuda.device_count()
    cfg = EngineConfig(model="x", device="cuda", moe_backend="offload", moe_peer_devices=f"cuda:{n}")
    lm_cfg = type("Ctx", (), {"config": cfg})()
    cache = type("Cache", (), {"device": torch.device("cuda:0"), "num_layers": 1, "num_experts": 1, "expert_nbytes": 1})()
    with pytest.raises(ValueError, match="not a visible GPU"):
        make_peer_tier(lm_cfg, cache)

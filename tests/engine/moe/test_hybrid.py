"""The `cpu` and `hybrid` backends: same greedy tokens as `resident` for every architecture, each route
computed exactly once (counted independently of the backend), no fetch during decode under `cpu`, the
fixed cap and the online controller of `hybrid`, and the registry wiring."""

import os

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.engine.config import EngineConfig, MoEBackend  # noqa: E402
from services.engine.models.registry import build_backend, load_model, pin_banks  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.hybrid import HybridBackend  # noqa: E402
from tests.helpers import CPU_PLAYS_THE_DEVICE, greedy_generate, on_cuda_with_resident_tokens, resident_greedy  # noqa: E402

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss"]
PROMPT = [(7 * i + 3) % 120 + 4 for i in range(40)]  # 40 tokens: prefill above the split path (offload)
SHORT = [5, 17, 33, 2, 90]  # 5 tokens: even the prefill takes the split path (T > 1 on the CPU)
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def resident_tokens(hf_checkpoints, loaded):
    return resident_greedy(loaded, hf_checkpoints, {"long": PROMPT, "short": SHORT}, NEW_TOKENS)


class RouteCounter:
    """Pass-through wrapper: counts valid routes itself and checks that `cpu` decode fetches nothing."""

    def __init__(self, inner: HybridBackend):
        self.inner, self.routes, self.decode_fetches = inner, 0, 0

    def forward(self, layer, hidden, topk_ids, topk_weights):
        self.routes += int((topk_ids >= 0).sum())
        before = int(self.inner.cache.state.fetched.sum())
        out = self.inner.forward(layer, hidden, topk_ids, topk_weights)
        if hidden.shape[0] == 1:
            self.decode_fetches += int(self.inner.cache.state.fetched.sum()) - before
        return out

    def stats(self):
        return self.inner.stats()


def run(lm, hf_dir, mode, slots, prompt=PROMPT, max_fetch=-1, use_triton=None, policy="lru"):
    cfg = EngineConfig(model=str(hf_dir), moe_backend=mode.value, moe_hybrid_max_fetch=max_fetch,
                       moe_cache_policy=policy)
    ctx = BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0)
    backend = HybridBackend(ctx, mode, num_slots=slots, use_triton=use_triton, count_routes=True)
    counter = RouteCounter(backend)
    lm.model.set_backend(counter)
    return greedy_generate(lm, prompt, NEW_TOKENS), backend, counter


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("mode", [MoEBackend.CPU, MoEBackend.HYBRID])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_resident(arch, mode, policy, hf_checkpoints, loaded, resident_tokens):
    lm = loaded[arch]
    tokens, backend, counter = run(lm, hf_checkpoints[arch].dir, mode, slots=lm.spec.top_k, policy=policy)
    assert tokens == resident_tokens[arch]["long"]
    # every route computed exactly once: GPU routes + CPU routes (counted by the C++ executor) = all routes
    assert backend.routes["gpu"] + backend.routes["cpu"] == counter.routes
    s = backend.stats()
    assert s["cpu_executor"]["routes_computed"] == backend.routes["cpu"] > 0
    assert s["cache"]["cpu_computed"] == s["cache"]["misses"] - s["cache"]["fetched"] > 0
    if mode is MoEBackend.CPU:
        assert counter.decode_fetches == 0
    else:
        assert s["split"]["steps"] >= NEW_TOKENS - 2 and s["split"]["cpu_bytes_per_second"] > 0


@pytest.mark.parametrize("mode", [MoEBackend.CPU, MoEBackend.HYBRID])
def test_short_prompt_splits_the_prefill_too(mode, hf_checkpoints, loaded, resident_tokens):
    lm = loaded["qwen2_moe"]
    tokens, backend, counter = run(lm, hf_checkpoints["qwen2_moe"].dir, mode, slots=lm.spec.num_experts, prompt=SHORT)
    assert tokens == resident_tokens["qwen2_moe"]["short"]
    assert backend.routes["gpu"] + backend.routes["cpu"] == counter.routes and backend.routes["cpu"] > 0


@pytest.mark.parametrize("max_fetch", [0, 1])
def test_fixed_cap(max_fetch, hf_checkpoints, loaded, resident_tokens):
    lm = loaded["qwen3_moe"]
    tokens, backend, counter = run(lm, hf_checkpoints["qwen3_moe"].dir, MoEBackend.HYBRID, slots=lm.spec.top_k,
                                   max_fetch=max_fetch)
    assert tokens == resident_tokens["qwen3_moe"]["long"]
    assert backend.routes["gpu"] + backend.routes["cpu"] == counter.routes
    if max_fetch == 0:
        assert counter.decode_fetches == 0
    else:  # at most one fetch per layer and decode step
        assert counter.decode_fetches <= (NEW_TOKENS - 1) * len(lm.banks.layers)


def test_backed_off_runs_plain_offload(hf_checkpoints, loaded, resident_tokens):
    """Controller at f = 1 (the CPU cannot help): no CPU submit at all, and still the same tokens."""
    lm = loaded["qwen3_moe"]
    cfg = EngineConfig(model=str(hf_checkpoints["qwen3_moe"].dir), moe_backend="hybrid")
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0), MoEBackend.HYBRID,
                            num_slots=lm.spec.top_k, count_routes=True)
    backend.controller.fraction, backend.controller.gain, backend.controller.probe_every = 1.0, 0.0, 0
    counter = RouteCounter(backend)
    lm.model.set_backend(counter)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == resident_tokens["qwen3_moe"]["long"]
    assert backend.stats()["cpu_executor"]["jobs"] == 0 and backend.routes["cpu"] == 0
    assert backend.routes["gpu"] == counter.routes
    assert backend.controller.steps >= NEW_TOKENS - 2  # backed-off steps are still observed (for probing)


@pytest.mark.parametrize("T", [16, 32])
@pytest.mark.parametrize("mode", [MoEBackend.CPU, MoEBackend.HYBRID])
def test_steps_past_eight_tokens_split_and_match_the_reference(T, mode, hf_checkpoints, loaded):
    """T = 16, 32 tokens (T*A past the old 64-route limit) still split: GPU slots + CPU, each route once,
    equal to the reference; the step lands in its own bucket."""
    from services.engine.moe.reference import moe_reference

    lm = loaded["qwen3_moe"]
    cfg = EngineConfig(model=str(hf_checkpoints["qwen3_moe"].dir), moe_backend=mode.value, max_running_requests=32)
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0), mode,
                            num_slots=lm.spec.top_k, count_routes=True)
    try:
        E, A, D = lm.spec.num_experts, lm.spec.top_k, lm.spec.hidden_size
        g = torch.Generator().manual_seed(T)
        for layer in range(len(lm.banks.layers)):
            h = torch.randn(T, D, generator=g)
            ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A]
            w = torch.rand(T, A, generator=g)
            banks = lm.banks.layers[layer].tensors
            want = moe_reference(h, ids, w, banks["gate_up"], banks["down"])
            torch.testing.assert_close(backend.forward(layer, h, ids, w), want, atol=1e-5, rtol=1e-5)
        assert backend.routes["gpu"] + backend.routes["cpu"] == T * A * len(lm.banks.layers)
        assert backend.routes["cpu"] > 0 and (mode is MoEBackend.CPU or backend.routes["gpu"] > 0)
        backend.observe_decode_step(0.01, T)
        s = backend.stats()
        assert s["buckets"][str(T)]["steps"] == 1 and s["split"]["bucket"] == str(T)
        assert s["buckets"][str(T)]["mode"] == ("cpu" if mode is MoEBackend.CPU else "hybrid")
    finally:
        backend.close()


@pytest.mark.parametrize("path", ["eager", "graph"])
def test_the_cpu_share_leaves_before_the_slots_are_assigned(path, hf_checkpoints, loaded):
    """The CPU is handed its routes right after the split, before the GPU routes get their slots (the CPU is
    the long side of most hybrid layers: it should not wait for the slot assignment), on the eager path and
    on the graph path's data flow (its handoff played by the executor itself); the layer still equals the
    reference."""
    from services.engine.moe.reference import moe_reference

    lm = loaded["qwen3_moe"]
    cfg = EngineConfig(model=str(hf_checkpoints["qwen3_moe"].dir), moe_backend="hybrid")
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0), MoEBackend.HYBRID,
                            num_slots=lm.spec.top_k)
    calls = []
    ensure_gpu, submit = backend._ensure_gpu, backend.executor.submit
    backend._ensure_gpu = lambda layer, gpu_ids: (calls.append("slots"), ensure_gpu(layer, gpu_ids))[1]
    backend.executor.submit = lambda *a, **k: (calls.append("cpu"), submit(*a, **k))[1]

    class ExecutorAsHandoff:  # the graph path's handoff calls, served by the executor on the host
        def submit(self, layer, hidden, ids, weights):
            backend.executor.submit(hidden, ids, weights, layer)

        def sync_add(self, layer, part, cache_counters=None):
            return (part.float() + backend.executor.wait()).to(part.dtype)

    try:
        E, A, D = lm.spec.num_experts, lm.spec.top_k, lm.spec.hidden_size
        g = torch.Generator().manual_seed(3)
        h, w = torch.randn(2, D, generator=g), torch.rand(2, A, generator=g)
        ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(2)])  # [T, A]
        if path == "graph":
            backend.handoff = ExecutorAsHandoff()
            out = backend._forward_graph(0, h, ids, w)
        else:
            out = backend.forward(0, h, ids, w)
        banks = lm.banks.layers[0].tensors
        torch.testing.assert_close(out, moe_reference(h, ids, w, banks["gate_up"], banks["down"]), atol=1e-5, rtol=1e-5)
        assert calls == ["cpu", "slots"]
    finally:
        backend.handoff = None
        backend.close()


@CPU_PLAYS_THE_DEVICE
def test_triton_kernels_under_the_interpreter(hf_checkpoints, loaded, resident_tokens):
    lm = loaded["mixtral"]
    tokens, backend, counter = run(lm, hf_checkpoints["mixtral"].dir, MoEBackend.HYBRID, slots=lm.spec.top_k,
                                   use_triton=True)
    assert tokens == resident_tokens["mixtral"]["long"]
    assert backend.routes["gpu"] + backend.routes["cpu"] == counter.routes


def test_registered_and_built_by_config(hf_checkpoints, loaded):
    lm = loaded["olmoe"]
    for mode in (MoEBackend.CPU, MoEBackend.HYBRID):
        backend = build_backend(lm, EngineConfig(model=str(hf_checkpoints["olmoe"].dir), moe_backend=mode.value,
                                                 moe_cache_size=lm.spec.top_k))
        assert isinstance(backend, HybridBackend) and backend.mode is mode
        s = backend.stats()
        assert s["backend"] == mode.value and s["c_sync_seconds"] > 0 and s["cpu_executor"]["isa"]
        ex = s["cpu_executor"]  # where the workers run (CPU device: every core, no other thread confined)
        assert len(ex["worker_cpus"]) == ex["threads"] and ex["spare_cpus"] == []
        assert isinstance(ex["worker_preemptions"], int) and ex["worker_preemptions"] >= 0
        backend.close()


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("graph_mode", [False, True], ids=["eager-handoff", "graph-handoff"])
@pytest.mark.parametrize("mode", [MoEBackend.CPU, MoEBackend.HYBRID])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "gpt_oss"])
def test_cuda_greedy_equals_resident(arch, mode, graph_mode, policy, hf_checkpoints):
    """The real data path: Triton ensure kernels, pinned handoff (stream-written flags), overlap."""
    d = str(hf_checkpoints[arch].dir)
    lm, want = on_cuda_with_resident_tokens(d, PROMPT, NEW_TOKENS)
    pin_banks(lm.banks)
    cfg = EngineConfig(model=d, device="cuda", moe_backend=mode.value, moe_cache_policy=policy)
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, lm.spec.top_k, 0), mode,
                            num_slots=lm.spec.top_k, count_routes=True, graph_mode=graph_mode)
    counter = RouteCounter(backend)
    lm.model.set_backend(counter)
    try:
        assert greedy_generate(lm, PROMPT, NEW_TOKENS) == want
        assert backend.routes["gpu"] + backend.routes["cpu"] == counter.routes and backend.routes["cpu"] > 0
        if mode is MoEBackend.CPU:
            assert counter.decode_fetches == 0
        assert backend.stats()["split"]["graph_mode"] is graph_mode
    finally:
        backend.close()


@pytest.mark.gpu
def test_graph_mode_layer_captures_and_replays(hf_checkpoints):
    """One hybrid layer captured in a CUDA graph, replayed on new inputs: equals the reference every time
    (the poller serves replays no Python sees; the split kernels read the fraction from the device)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from services.engine.moe.reference import moe_reference

    d = str(hf_checkpoints["qwen3_moe"].dir)
    lm = load_model(EngineConfig(model=d, device="cuda"), attach_backend=False)
    pin_banks(lm.banks)
    cfg = EngineConfig(model=d, device="cuda", moe_backend="hybrid")
    E, A, D = lm.spec.num_experts, lm.spec.top_k, lm.spec.hidden_size
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, A, 0), MoEBackend.HYBRID,
                            num_slots=E, graph_mode=True)
    dev = torch.device("cuda")
    h, ids, w = torch.zeros(2, D, device=dev), torch.zeros(2, A, dtype=torch.int64, device=dev), torch.zeros(2, A, device=dev)
    g = torch.Generator().manual_seed(0)

    def fill():
        h.copy_(torch.randn(2, D, generator=g))
        ids.copy_(torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(2)]))
        w.copy_(torch.rand(2, A, generator=g))

    try:
        fill()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles outside the capture
            backend.forward(0, h, ids, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(0, h, ids, w)
        banks = lm.banks.layers[0].tensors
        for _ in range(6):
            fill()
            graph.replay()
            torch.cuda.synchronize()
            want = moe_reference(h.cpu(), ids.cpu(), w.cpu(), banks["gate_up"].float(), banks["down"].float())
            torch.testing.assert_close(out.cpu(), want, atol=2e-3, rtol=2e-3)  # TF32-level GEMM noise allowed
        assert backend.handoff.poll_stats()["error"] == ""
    finally:
        backend.close()


@pytest.mark.gpu
@pytest.mark.parametrize("T", [16, 32])
def test_graph_mode_captures_the_split_at_many_tokens(T, hf_checkpoints):
    """A hybrid layer of 16 / 32 tokens (past the old 64-route limit) captured in a CUDA graph splits
    (CPU routes > 0) and equals the reference on every replay; its bucket's fraction, changed between
    replays by a plain store, moves the split without a recapture. The cache has a slot per expert of the
    layer and is emptied before each replay, so every present expert is a miss and f alone decides the
    split (with fewer slots than a step's misses, f = 1 still computes the overflow on the CPU)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from services.engine.moe.reference import moe_reference
    from services.engine.moe.split import Q16

    d = str(hf_checkpoints["qwen3_moe"].dir)
    lm = load_model(EngineConfig(model=d, device="cuda"), attach_backend=False)
    pin_banks(lm.banks)
    cfg = EngineConfig(model=d, device="cuda", moe_backend="hybrid", max_running_requests=32)
    E, A, D = lm.spec.num_experts, lm.spec.top_k, lm.spec.hidden_size
    backend = HybridBackend(BackendContext(lm.banks, cfg, lm.device, lm.dtype, A, 0), MoEBackend.HYBRID,
                            num_slots=E, graph_mode=True)
    dev = torch.device("cuda")
    h, ids, w = torch.zeros(T, D, device=dev), torch.zeros(T, A, dtype=torch.int64, device=dev), torch.zeros(T, A, device=dev)
    g = torch.Generator().manual_seed(T)

    def fill():
        h.copy_(torch.randn(T, D, generator=g))
        ids.copy_(torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]))
        w.copy_(torch.rand(T, A, generator=g))

    try:
        state = backend.cache.state
        counters = [int(state.misses.sum()), int(state.hits.sum()), backend.handoff.poll_stats()["routes"]]
        assert backend.warm(h[:1]) > 0  # every size class compiled, through skipped routes only:
        assert [int(state.misses.sum()), int(state.hits.sum()), backend.handoff.poll_stats()["routes"]] == counters
        fill()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            backend.forward(0, h, ids, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = backend.forward(0, h, ids, w)
        banks = lm.banks.layers[0].tensors
        bucket = backend.buckets.index(T)
        routes = []
        for q16 in (Q16 // 4, Q16 // 4, Q16, 0):  # the bucket's word, stored between replays
            backend.buckets.f_q16[bucket] = q16
            state.slot_of_id.fill_(-1)  # in place: the graph holds these tables' addresses
            state.id_of_slot.fill_(-1)
            before = backend.handoff.poll_stats()["routes"]
            fill()
            graph.replay()
            torch.cuda.synchronize()
            routes.append(backend.handoff.poll_stats()["routes"] - before)
            want = moe_reference(h.cpu(), ids.cpu(), w.cpu(), banks["gate_up"].float(), banks["down"].float())
            torch.testing.assert_close(out.cpu(), want, atol=2e-3, rtol=2e-3)
        assert routes[0] > 0 and routes[2] == 0 and routes[3] > routes[0]  # f = 1: offload; f = 0: all misses on the CPU
        assert backend.handoff.poll_stats()["error"] == ""
    finally:
        backend.close()


@pytest.mark.gpu
def test_engine_captures_hybrid_decode_graphs_at_16_and_32(hf_checkpoints):
    """A CUDA engine with hybrid at --max-running-requests 32: the decode graphs of batch 16 and 32 capture
    the split (the runner checks each replay against an eager forward), 32 concurrent requests replay
    them, and their buckets show the CPU's share."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import asyncio

    from services.engine.engine import Engine
    from services.engine.runtime.sampler import SamplingParams
    from tests.helpers import model_thread_held

    ckpt = hf_checkpoints["qwen3_moe"]
    engine = Engine(EngineConfig(model=str(ckpt.dir), device="cuda", moe_backend="hybrid", max_running_requests=32,
                                 max_waiting_requests=64, max_seq_len=64, moe_cache_rate=0.25))
    engine.start()
    try:
        engine.wait_ready(600)

        async def run():
            async with model_thread_held(engine):
                streams = [engine.submit(f"r{i}", [(7 * i + k) % 100 + 3 for k in range(4 + i % 5)],
                                         SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
                           for i in range(32)]
            counts = []
            for stream in streams:
                n = 0
                async for out in stream:
                    n += len(out["token_ids"])
                counts.append(n)
            return counts, await engine.stats()

        counts, stats = asyncio.run(run())
        assert counts == [8] * 32
        assert {16, 32} <= set(stats["cuda_graph_sizes"])
        buckets = stats["experts"]["buckets"]
        assert buckets["32"]["steps"] >= 2 and buckets["32"]["controller"]["cpu_bytes_per_second"] > 0
        assert stats["experts"]["split"]["graph_mode"] is True
    finally:
        engine.shutdown()

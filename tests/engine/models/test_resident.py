"""The resident backend's two expert paths equal the pure-torch moe_reference."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.moe.backends import BackendContext, make_backend
from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.reference import moe_reference
from services.engine.moe.resident import ResidentBackend, moe_gathered, moe_grouped
from tests.helpers import tolerance

E, D, I = 8, 32, 16


def _case(T: int, A: int, seed: int, skip: bool):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A] distinct per row
    if skip:
        ids[torch.rand(T, A, generator=g) < 0.3] = -1
    weights = torch.rand(T, A, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g) * 0.1
    down = torch.randn(E, D, I, generator=g) * 0.1
    return hidden, ids, weights, gate_up, down


@pytest.mark.parametrize("impl", [moe_grouped, moe_gathered])
@pytest.mark.parametrize("T, A, skip", [(1, 2, False), (1, 8, False), (7, 2, True), (33, 4, True), (64, 1, False)])
def test_paths_equal_reference(impl, T, A, skip):
    hidden, ids, weights, gate_up, down = _case(T, A, seed=T * 10 + A, skip=skip)
    got = impl(hidden, ids, weights, gate_up, down)
    ref = moe_reference(hidden, ids, weights, gate_up, down)
    assert got.shape == (T, D)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_torch_fallback_groups_past_decode_sizes(monkeypatch):
    """Without the Triton kernels a prefill-sized step must not take the gather path (it would copy R
    experts' weights: GBs at a real prompt); decode-sized steps still do (no host sync)."""
    import services.engine.moe.resident as resident

    gathered = []
    monkeypatch.setattr(resident, "moe_gathered", lambda *a: gathered.append(a[1].numel()) or moe_gathered(*a))
    kernel = resident.DecodeKernel("torch")
    for T, A in ((40, 2), (8, 8)):  # R = 80 (above GATHER_MAX_ROUTES), R = 64
        hidden, ids, weights, gate_up, down = _case(T, A, seed=T, skip=True)
        torch.testing.assert_close(kernel(hidden, ids, weights, gate_up, down),
                                   moe_reference(hidden, ids, weights, gate_up, down), atol=1e-5, rtol=1e-5)
    assert gathered == [64]


def test_triton_path_takes_the_gemv_for_a_few_routes_and_the_gemm_beyond():
    """GEMV up to GEMV_MAX_ROUTES (it reads an expert per route), the grouped GEMM beyond, gpt-oss experts
    (biases) to both; both kernels stubbed by the reference."""
    import services.engine.moe.resident as resident

    calls = []
    kernel = resident.DecodeKernel("triton")
    kernel._gemv = lambda *a, act=None, bias=None, gguf_types=None: calls.append(("gemv", a[1].numel())) or moe_reference(*a[:5], act, bias)
    kernel._gemm = lambda *a, **k: calls.append(("gemm", a[1].numel())) or moe_reference(*a[:7])
    for T, A in ((1, 8), (2, 8), (3, 8), (40, 2)):
        args = _case(T, A, seed=T, skip=True)
        torch.testing.assert_close(kernel(*args), moe_reference(*args), atol=1e-5, rtol=1e-5)
    bias = (torch.randn(E, 2 * I), torch.randn(E, D))
    for T in (1, 20):
        args = _case(T, 2, seed=0, skip=False)
        torch.testing.assert_close(kernel(*args, None, bias), moe_reference(*args, None, bias), atol=1e-5, rtol=1e-5)
    assert calls == [("gemv", 8), ("gemv", 16), ("gemm", 24), ("gemm", 80), ("gemv", 2), ("gemm", 40)]
    assert resident.GEMV_MAX_ROUTES == 16


def test_backend_registered_and_moves_banks():
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 2, E, D, I, torch.float32)
    for layer in banks.layers:
        for t in layer.tensors.values():
            t.normal_()
    ctx = BackendContext(banks=banks, config=EngineConfig(model="x"), device=torch.device("cpu"),
                         dtype=torch.float32, top_k=2, weight_bytes_on_device=0)
    backend = make_backend(ctx)
    assert isinstance(backend, ResidentBackend)
    hidden, ids, weights, _, _ = _case(5, 2, seed=0, skip=False)
    out = backend.forward(1, hidden, ids, weights)
    ref = moe_reference(hidden, ids, weights, banks.layers[1].tensors["gate_up"], banks.layers[1].tensors["down"])
    torch.testing.assert_close(out, ref, atol=tolerance(torch.float32), rtol=0)
    assert backend.stats()["backend"] == "resident"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [3, 16, 100])
def test_cuda_decode_uses_triton_kernel(T):
    """On CUDA the resident path runs the Triton kernels (GEMV at T=3 x top-2, grouped GEMM beyond; no
    silent fallback) and is correct, and warm() compiles them all."""
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 1, E, D, I, torch.bfloat16)
    for t in banks.layers[0].tensors.values():
        t.normal_(0, 0.1)
    ctx = BackendContext(banks=banks, config=EngineConfig(model="x", device="cuda", dtype="bfloat16"),
                         device=torch.device("cuda"), dtype=torch.bfloat16, top_k=2, weight_bytes_on_device=0)
    backend = make_backend(ctx)
    hidden, ids, weights, _, _ = (t.cuda() for t in _case(T, 2, seed=5, skip=True))
    assert backend.warm(hidden.bfloat16()) >= 2
    out = backend.forward(0, hidden.bfloat16(), ids, weights)
    assert backend.stats()["decode_kernel"] == "triton"
    ref = moe_reference(hidden, ids, weights, *(banks.layers[0].tensors[n].float().cuda() for n in ("gate_up", "down")))
    torch.testing.assert_close(out.float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gathered_path_under_cuda_graph_bf16():
    """The decode path (gathered) captured in a CUDA graph, replayed with new routes, equals the
    reference computed in fp32 (bf16 tolerance)."""
    hidden, ids, weights, gate_up, down = (t.cuda() for t in _case(1, 8, seed=3, skip=False))
    gate_up, down, hidden = gate_up.bfloat16(), down.bfloat16(), hidden.bfloat16()
    static = [hidden.clone(), ids.clone(), weights.clone()]
    moe_gathered(*static, gate_up, down)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gathered(*static, gate_up, down)
    new = _case(1, 8, seed=4, skip=True)
    static[0].copy_(new[0].cuda().bfloat16()); static[1].copy_(new[1].cuda()); static[2].copy_(new[2].cuda())
    graph.replay()
    ref = moe_reference(static[0].float(), static[1], static[2], gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)

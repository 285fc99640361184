"""kernels/synthetic_route.py: the Triton kernel gives its torch reference's experts and weights; the process is
stateless (a prompt taken in chunks, or a decode row, routes as the whole sequence did); a token's experts are
distinct; each request (salt) and each layer draw their own experts."""

from __future__ import annotations

import pytest
import torch

from kernels.synthetic_route import LANE_SPAN, synthetic_route, synthetic_route_ref
from services.engine.moe.routing_presets import PRESETS, RoutingTables, SyntheticRouting


def _routing(name: str, E: int, A: int, layers: int = 2, renormalize: bool = True) -> SyntheticRouting:
    r = SyntheticRouting(RoutingTables.from_preset(PRESETS[name], layers, E, seed=3), name, 3, A, renormalize,
                         torch.device("cpu"), max_slots=3)
    r.assign([0, 1], ["req-a", "req-b"])
    return r


def _args(r: SyntheticRouting, logits, positions, slots, layer: int = 0):
    return (logits, positions, slots, r.salt, r.keys[layer], r.stay[layer], r.cdf[layer], r.perm[layer], r.top_k,
            r.renormalize)


@pytest.mark.parametrize("name, E, A, renormalize", [("sticky", 128, 8, True), ("moderate", 40, 6, False),
                                                     ("flat", 16, 4, True), ("sticky", 8, 8, True)])  # A = E: every lane collides but one
def test_kernel_equals_reference(name, E, A, renormalize):
    r = _routing(name, E, A, renormalize=renormalize)
    # two requests; positions at 0, around a lane-span boundary and far in the sequence
    positions = torch.tensor([0, 1, 2, LANE_SPAN - 1, LANE_SPAN, 5000, 0, 7], dtype=torch.long)
    slots = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.long)
    logits = torch.randn(len(positions), E, generator=torch.Generator().manual_seed(0))
    w_ref, ids_ref = synthetic_route_ref(*_args(r, logits, positions, slots))
    w, ids = synthetic_route(*_args(r, logits, positions, slots))
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    assert all(len(set(row)) == A for row in ids_ref.tolist())  # distinct within each token
    probs = torch.softmax(logits, -1).gather(1, ids_ref)  # the router's softmax over the chosen set
    torch.testing.assert_close(w_ref, probs / probs.sum(1, keepdim=True) if renormalize else probs)


def test_stateless_chunks_and_rows_route_like_the_whole_sequence():
    r = _routing("sticky", 128, 8)
    T = 300
    logits = torch.randn(T, 128)
    whole = synthetic_route_ref(*_args(r, logits, torch.arange(T), torch.zeros(T, dtype=torch.long)))[1]
    pieces = [synthetic_route_ref(*_args(r, logits[a:b], torch.arange(a, b), torch.zeros(b - a, dtype=torch.long)))[1]
              for a, b in ((0, 100), (100, 101), (101, 300))]  # a chunk, one decode row, the rest
    assert torch.equal(torch.cat(pieces), whole)


def test_requests_and_layers_draw_their_own_experts():
    r = _routing("sticky", 128, 8)
    T = 64
    logits = torch.zeros(T, 128)
    pos = torch.arange(T)
    a = synthetic_route_ref(*_args(r, logits, pos, torch.zeros(T, dtype=torch.long)))[1]
    b = synthetic_route_ref(*_args(r, logits, pos, torch.ones(T, dtype=torch.long)))[1]
    a1 = synthetic_route_ref(*_args(r, logits, pos, torch.zeros(T, dtype=torch.long), layer=1))[1]
    same = lambda x, y: (x[:, :, None] == y[:, None, :]).any(-1).float().mean().item()  # noqa: E731
    assert same(a, b) < 0.7 and same(a, a1) < 0.7  # overlap from the shared popularity only
    r.assign([0], ["req-b"])  # slot 0 now holds request b: it routes as b did in slot 1
    assert torch.equal(synthetic_route_ref(*_args(r, logits, pos, torch.zeros(T, dtype=torch.long)))[1], b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_and_graph_replays_equal_the_reference():
    """On the GPU: the compiled kernel gives the reference's experts at every decode size class, inside a captured
    graph replayed at new positions and slots too."""
    r = _routing("sticky", 128, 8, layers=1)
    r.reserve(8)
    r.assign(list(range(8)), [f"q{i}" for i in range(8)])
    cuda = SyntheticRouting(RoutingTables.from_preset(PRESETS["sticky"], 1, 128, seed=3), "sticky", 3, 8, True,
                            torch.device("cuda"), max_slots=8)
    cuda.assign(list(range(8)), [f"q{i}" for i in range(8)])
    logits = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(8, dtype=torch.long, device="cuda")
    slots = torch.arange(8, device="cuda")
    static_args = (logits, pos, slots, cuda.salt, cuda.keys[0], cuda.stay[0], cuda.cdf[0], cuda.perm[0], 8, True)
    synthetic_route(*static_args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = synthetic_route(*static_args)
    for step in (0, 5, 63, 64, 1000):
        pos.copy_(torch.arange(8, device="cuda") + step)
        graph.replay()
        w_ref, ids_ref = synthetic_route_ref(*_args(r, logits.float().cpu(), pos.cpu(), slots.cpu()))
        assert torch.equal(ids.cpu(), ids_ref)
        torch.testing.assert_close(w.cpu(), w_ref, rtol=2e-3, atol=1e-4)

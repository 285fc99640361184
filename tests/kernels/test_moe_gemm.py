"""kernels/moe_gemm against moe_reference (and fp8.dequantize + moe_reference for fp8_block banks): the route
alignment's invariants, shapes with 1, odd sizes, several tiles per expert, skipped routes (-1), every launch
config of the table, gpt-oss expert math (biases, clamped SwiGLU), fp32 under the interpreter; bf16 and
CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemm import CONFIGS, GemmConfig, align_routes, moe_gemm, moe_gemm_torch, num_tiles
from services.engine.moe.reference import ClampedSwiGLU, moe_reference
from tests.helpers import tolerance
from tests.kernels.conftest import kernel_device
from tests.kernels.test_moe_gemv_fp8 import assert_close, fp8_case, reference as fp8_reference

SMALL = GemmConfig(16, 16, 32, 16, 32, num_warps=4, num_stages=2)  # small blocks: many tiles and k-steps
CASES = [  # T, A, E, D, I
    (1, 1, 4, 32, 16),  # one route
    (1, 8, 16, 64, 48),
    (3, 2, 8, 33, 17),  # odd sizes: masked tails everywhere
    (8, 4, 8, 80, 20),  # 32 routes over 8 experts: several tiles per expert
    (40, 2, 5, 48, 40),  # prefill-sized: 80 routes over 5 experts
]


def _case(T, A, E, D, I, seed, dtype, device, skip=True, bias=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    if skip:
        ids[torch.rand(T, A, generator=g) < 0.25] = -1
    weights = torch.rand(T, A, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    args = [t.to(device) for t in (hidden.to(dtype), ids, weights, gate_up.to(dtype), down.to(dtype))]
    biases = (torch.randn(E, 2 * I, generator=g).to(device, dtype), torch.randn(E, D, generator=g).to(device, dtype))
    return args, (biases if bias else None)


@pytest.mark.parametrize("R, E, block_m", [(1, 4, 16), (8, 128, 16), (37, 3, 16), (300, 8, 64), (5, 5, 16),
                                           (600, 300, 16), (700, 2, 16)])  # E > BLOCK_E; many tiles of one expert
def test_alignment_puts_every_route_once_in_a_tile_of_its_expert(R, E, block_m):
    g = torch.Generator().manual_seed(R)
    ids = torch.randint(-1, E, (R,), generator=g).to(kernel_device())
    routes, tile_expert = align_routes(ids, E, block_m)
    NT = num_tiles(R, E, block_m)
    assert routes.shape == (NT * block_m,) and tile_expert.shape == (NT,)
    routes, tile_expert, ids = routes.cpu().view(NT, block_m), tile_expert.cpu(), ids.cpu()
    seen = []
    for m in range(NT):
        if tile_expert[m] < 0:  # its rows are never read (unset)
            continue
        assert ((routes[m] >= 0) & (routes[m] <= R)).all(), "a row of a used tile is neither a route nor padding"
        rows = routes[m][routes[m] < R]
        assert rows.numel() > 0, "a used tile holds no route"
        assert torch.equal(routes[m][:rows.numel()], rows), "padding before a route"
        assert (ids[rows.long()] == tile_expert[m]).all(), "a route sits in another expert's tile"
        assert torch.equal(rows, rows.sort().values), "routes of a tile are out of route order"
        seen += rows.tolist()
    assert sorted(seen) == [r for r in range(R) if ids[r] >= 0]
    used = tile_expert >= 0
    assert used[:int(used.sum())].all(), "an unused tile before a used one"


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_fp32_matches_reference(T, A, E, D, I):
    args, _ = _case(T, A, E, D, I, seed=T + D, dtype=torch.float32, device=kernel_device())
    ref = moe_reference(*args)
    torch.testing.assert_close(moe_gemm(*args, config=SMALL), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_gemm_torch(*args), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [cfg for _, cfg in CONFIGS["default"]], ids=lambda c: f"m{c.block_m}")
def test_every_table_config_matches_reference(cfg):
    args, _ = _case(20, 4, 6, 160, 72, seed=5, dtype=torch.float32, device=kernel_device())
    torch.testing.assert_close(moe_gemm(*args, config=cfg), moe_reference(*args), atol=1e-5, rtol=1e-5)


def test_all_routes_skipped_gives_zeros():
    args, _ = _case(3, 2, 4, 32, 16, seed=0, dtype=torch.float32, device=kernel_device())
    args[1].fill_(-1)
    assert torch.equal(moe_gemm(*args, config=SMALL).cpu(), torch.zeros(3, 32))


def test_gpt_oss_experts_match_reference():
    args, bias = _case(6, 2, 4, 48, 24, seed=7, dtype=torch.float32, device=kernel_device(), bias=True)
    act = ClampedSwiGLU(alpha=1.702, limit=0.5)  # a low limit: the clamps bite
    ref = moe_reference(*args, act, bias)
    torch.testing.assert_close(moe_gemm(*args, act, bias, config=SMALL), ref, atol=1e-5, rtol=1e-5)


FP8_CASES = [  # T, A, E, D, I
    (1, 1, 2, 64, 32),  # one partial block each way
    (3, 2, 5, 256, 130),  # up's scale rows start at 2, not at I // 128; a k-step straddles no block edge
    (12, 3, 3, 160, 96),  # several tiles per expert
]


@pytest.mark.parametrize("T, A, E, D, I", FP8_CASES)
def test_fp8_matches_reference(T, A, E, D, I):
    hidden, ids, weights, gate_up, down, gs, ds = fp8_case(T, A, E, D, I, seed=T + D, device=kernel_device())
    ref = fp8_reference(hidden, ids, weights, gate_up, down, gs, ds)
    out = moe_gemm(hidden, ids, weights, gate_up, down, gate_up_scale=gs, down_scale=ds, config=SMALL)
    assert_close(out, ref, atol=2e-5)


def test_fp8_needs_k_blocks_inside_a_scale_block():
    hidden, ids, weights, gate_up, down, gs, ds = fp8_case(1, 1, 2, 64, 32, seed=0, device=kernel_device())
    with pytest.raises(ValueError, match="block_k and block_k2 dividing 128"):
        moe_gemm(hidden, ids, weights, gate_up, down, gate_up_scale=gs, down_scale=ds,
                 config=GemmConfig(16, 16, 96, 16, 32))


def test_bad_shapes_are_refused():
    args, _ = _case(2, 2, 4, 32, 16, seed=0, dtype=torch.float32, device=kernel_device())
    with pytest.raises(ValueError, match=r"do not match \[T, D\]"):
        moe_gemm(args[0][:, :16], *args[1:])


GPU_CASES = CASES + [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768), (16, 8, 128, 2048, 768),
                     (240, 8, 128, 2048, 768)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T, A, E, D, I", GPU_CASES)
def test_bf16_on_gpu_matches_reference(T, A, E, D, I):
    args, _ = _case(T, A, E, D, I, seed=1, dtype=torch.bfloat16, device="cuda")
    ref = moe_reference(*[a.float() if a.is_floating_point() else a for a in args])
    torch.testing.assert_close(moe_gemm(*args).float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 16, 240])
def test_fp8_bf16_on_gpu_matches_reference(T):
    args = fp8_case(T, 8, 128, 2048, 768, seed=1, device="cuda", dtype=torch.bfloat16)
    hidden, ids, weights, gate_up, down, gs, ds = args
    assert_close(moe_gemm(hidden, ids, weights, gate_up, down, gate_up_scale=gs, down_scale=ds),
                 fp8_reference(*args), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_bf16_on_gpu_matches_reference():
    args, bias = _case(32, 4, 32, 256, 128, seed=3, dtype=torch.bfloat16, device="cuda", bias=True)
    act = ClampedSwiGLU()
    ref = moe_reference(*[a.float() if a.is_floating_point() else a for a in args], act,
                        tuple(b.float() for b in bias))
    torch.testing.assert_close(moe_gemm(*args, act, bias).float(), ref, atol=5e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [16, 64])
def test_cuda_graph_replay(T):
    (hidden, ids, weights, gate_up, down), _ = _case(T, 8, 128, 2048, 768, seed=2, dtype=torch.bfloat16,
                                                     device="cuda")
    moe_gemm(hidden, ids, weights, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemm(hidden, ids, weights, gate_up, down)
    (h2, i2, w2, _, _), _ = _case(T, 8, 128, 2048, 768, seed=3, dtype=torch.bfloat16, device="cuda")
    i2[:, 0] = 7  # every token on expert 7: a tile layout unlike the captured step's
    hidden.copy_(h2); ids.copy_(i2); weights.copy_(w2)
    graph.replay()
    ref = moe_reference(hidden.float(), ids, weights, gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)

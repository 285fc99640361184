"""kernels/moe_gemv against moe_reference: shapes with 1, odd sizes, a prefill and a Qwen3-30B-A3B-sized layer
(GPU only), skipped routes (-1), fp32 and bf16, and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemv import moe_gemv
from services.engine.moe.reference import moe_reference
from tests.helpers import tolerance
from tests.kernels.conftest import kernel_device

CASES = [  # T, A, E, D, I
    (1, 1, 4, 32, 16),
    (1, 8, 16, 64, 48),
    (3, 2, 8, 33, 17),  # odd sizes: masked tails in both kernels
    (8, 4, 8, 300, 20),  # D > BLOCK_K1: several k-steps
    (40, 2, 8, 32, 16),  # prefill-sized (R = 80 > the decode path's 64): resident and offload prefills on CUDA
]


def _case(T, A, E, D, I, seed, dtype, device, skip=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    if skip:
        ids[torch.rand(T, A, generator=g) < 0.25] = -1
    weights = torch.rand(T, A, generator=g)
    gate_up = torch.randn(E, 2 * I, D, generator=g) / D ** 0.5
    down = torch.randn(E, D, I, generator=g) / I ** 0.5
    return [t.to(device) for t in (hidden.to(dtype), ids, weights, gate_up.to(dtype), down.to(dtype))]


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_fp32_matches_reference(T, A, E, D, I):
    args = _case(T, A, E, D, I, seed=T + D, dtype=torch.float32, device=kernel_device())
    torch.testing.assert_close(moe_gemv(*args), moe_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T, A, E, D, I", CASES + [(1, 8, 128, 2048, 768), (4, 8, 128, 2048, 768),
                                                  (132, 8, 128, 2048, 768)])
def test_bf16_on_gpu_matches_reference(T, A, E, D, I):
    args = _case(T, A, E, D, I, seed=1, dtype=torch.bfloat16, device="cuda")
    ref = moe_reference(*[a.float() if a.is_floating_point() else a for a in args])
    torch.testing.assert_close(moe_gemv(*args).float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay():
    hidden, ids, weights, gate_up, down = _case(1, 8, 128, 2048, 768, seed=2, dtype=torch.bfloat16, device="cuda")
    moe_gemv(hidden, ids, weights, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(hidden, ids, weights, gate_up, down)
    new = _case(1, 8, 128, 2048, 768, seed=3, dtype=torch.bfloat16, device="cuda")
    hidden.copy_(new[0]); ids.copy_(new[1]); weights.copy_(new[2])
    graph.replay()
    ref = moe_reference(hidden.float(), ids, weights, gate_up.float(), down.float())
    torch.testing.assert_close(out.float(), ref, atol=tolerance(torch.bfloat16), rtol=2e-2)

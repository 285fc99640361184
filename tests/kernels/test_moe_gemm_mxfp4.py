"""kernels/moe_gemm on MXFP4 banks (the format of kernels/moe_gemv.py) against the torch reference
(models/mxfp4.dequantize + moe_reference): random bytes over the whole code space and E8M0 scales around the
bias, with and without gpt-oss's biases and clamped SwiGLU, every launch config of the table and a small one
(many tiles and k-steps, BLOCK_K = 32: one scale block per step), skipped routes; fp32 under the interpreter,
bf16 and CUDA-graph replay on the GPU. The GEMV's tests (test_moe_gemv_gpt_oss.py) pin the nibble order and
the exponent bias with hand-computed values; here the same banks must give the same result."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemm import GemmConfig, all_configs, moe_gemm
from kernels.moe_gemv import moe_gemv
from services.engine.moe.reference import moe_reference
from tests.kernels.conftest import kernel_device
from tests.kernels.test_moe_gemv_gpt_oss import ACT, assert_close, case, dense, reference

SMALL = GemmConfig(16, 16, 32, 16, 32, num_warps=4, num_stages=2)
CASES = [  # T, A, E, D, I
    (1, 1, 2, 32, 32),
    (3, 2, 5, 64, 160),  # D/2 = 32 bytes: partial byte steps at BLOCK_K 64 and 128
    (8, 4, 8, 288, 96),  # 32 routes over 8 experts: several tiles per expert
    (40, 2, 8, 96, 64),  # prefill-sized
]


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_mxfp4_gpt_oss_matches_reference(T, A, E, D, I):
    hidden, ids, weights, banks, bias = case(T, A, E, D, I, seed=T + I, device=kernel_device())
    gate_up, down, gs, ds = banks
    ref = reference(hidden, ids, weights, banks, bias)
    for cfg in [SMALL, *all_configs(hidden.device)]:
        assert_close(moe_gemm(hidden, ids, weights, gate_up, down, ACT, bias, gs, ds, config=cfg), ref, atol=2e-5)


def test_mxfp4_plain_experts_match_reference():
    hidden, ids, weights, (gate_up, down, gs, ds), _ = case(8, 4, 8, 288, 96, seed=3, device=kernel_device())
    ref = moe_reference(hidden.cpu(), ids.cpu(), weights.cpu(), dense(gate_up, gs), dense(down, ds))
    assert_close(moe_gemm(hidden, ids, weights, gate_up, down, None, None, gs, ds, config=SMALL), ref, atol=2e-5)


def test_mxfp4_scales_of_the_wrong_shape_are_refused():
    hidden, ids, weights, (gate_up, down, gs, ds), _ = case(1, 1, 2, 64, 32, seed=0, device=kernel_device())
    with pytest.raises(ValueError, match=r"MXFP4 banks need .* scales \[E, 2I, D/32\]"):
        moe_gemm(hidden, ids, weights, gate_up, down, None, None, gs[:, :, :1], ds)
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_gemm(hidden, ids, weights, gate_up, down, None, None, gs, ds, config=GemmConfig(16, 16, 16, 16, 16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [3, 16, 64, 512])
def test_bf16_gpt_oss_geometry_on_gpu(T):
    """gpt-oss-120b's D, I and top-4 at 32 experts, bf16: the GEMM against the reference and the GEMV."""
    hidden, ids, weights, banks, bias = case(T, 4, 32, 2880, 2880, seed=T, device="cuda", dtype=torch.bfloat16)
    got = moe_gemm(hidden, ids, weights, banks[0], banks[1], ACT, bias, banks[2], banks[3])
    assert_close(got, reference(hidden, ids, weights, banks, bias), atol=1e-2)
    gemv = moe_gemv(hidden, ids, weights, *banks, act=ACT, bias=bias)
    assert_close(got, gemv.float().cpu(), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_replay():
    hidden, ids, weights, banks, bias = case(32, 4, 32, 2880, 2880, seed=2, device="cuda", dtype=torch.bfloat16)
    args = (banks[0], banks[1], ACT, bias, banks[2], banks[3])
    moe_gemm(hidden, ids, weights, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemm(hidden, ids, weights, *args)
    new = case(32, 4, 32, 2880, 2880, seed=3, device="cuda", dtype=torch.bfloat16)
    for old, fresh in zip((hidden, ids, weights), new[:3]):
        old.copy_(fresh)
    graph.replay()
    assert_close(out, reference(hidden, ids, weights, banks, bias), atol=1e-2)

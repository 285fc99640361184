"""kernels/moe_gemv with gpt-oss expert math and MXFP4 banks, against the torch reference
(models/mxfp4.dequantize + moe_reference with ClampedSwiGLU and the biases).

MXFP4 weights are random bytes over the whole code space (both nibbles, both signs, e2m1 subnormals) with
random E8M0 scales around the bias, so a swapped nibble order or an off-by-one exponent bias breaks the
match; one test also checks hand-computed values that do not go through models/mxfp4.dequantize. fp32
activations under the interpreter; bf16 and CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemv import moe_gemv
from services.engine.models.mxfp4 import dequantize
from services.engine.moe.reference import ClampedSwiGLU, moe_reference
from tests.kernels.conftest import kernel_device

ACT = ClampedSwiGLU()
CASES = [  # T, A, E, D, I
    (1, 1, 2, 32, 32),  # one scale block each way
    (1, 4, 8, 288, 96),  # D/2 = 144 bytes: a full and a partial 128-byte step, blocks straddling it
    (3, 2, 5, 64, 160),
    (40, 2, 8, 96, 64),  # prefill-sized
]


def mx_banks(E, D, I, g):
    """Random MXFP4 banks in the bank layout: gate_up [E, 2I, D/2], down [E, D, I/2] uint8 and their
    E8M0 scales [E, 2I, D/32], [E, D, I/32] (exponents 2**-8 .. 2**2 around the bias 127)."""
    gate_up = torch.randint(0, 256, (E, 2 * I, D // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    down = torch.randint(0, 256, (E, D, I // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    gs = torch.randint(119, 130, (E, 2 * I, D // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    ds = torch.randint(119, 130, (E, D, I // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    return gate_up, down, gs, ds


def dense(q, s):
    """A bank's [E, N, K/2] bytes and [E, N, K/32] scales -> [E, N, K] fp32 (the reference's first step)."""
    E, N, KB = q.shape
    return dequantize(q.cpu().reshape(E, N, KB // 16, 16), s.cpu(), torch.float32)


def case(T, A, E, D, I, seed, device, dtype=torch.float32, mx=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    skip = torch.rand(T, A, generator=g) < 0.25
    skip[0, 0] = False  # at least one route computed
    ids[skip] = -1
    weights = torch.rand(T, A, generator=g)
    bias = (torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g))
    if mx:
        banks = mx_banks(E, D, I, g)
    else:  # large enough that the clamp at +-7 bites on many rows
        banks = (torch.randn(E, 2 * I, D, generator=g) * 4 / D ** 0.5, torch.randn(E, D, I, generator=g) / I ** 0.5)
        banks = tuple(b.to(dtype) for b in banks)
    hidden, bias = hidden.to(dtype), tuple(b.to(dtype) for b in bias)
    to = lambda t: t.to(device)  # noqa: E731
    return to(hidden), to(ids), to(weights), [to(b) for b in banks], tuple(to(b) for b in bias)


def reference(hidden, ids, weights, banks, bias):
    if len(banks) == 4:
        gate_up, down = dense(banks[0], banks[2]), dense(banks[1], banks[3])
    else:
        gate_up, down = (b.cpu().float() for b in banks)
    return moe_reference(hidden.cpu().float(), ids.cpu(), weights.cpu(), gate_up, down, ACT,
                         tuple(b.cpu().float() for b in bias))


def assert_close(out, ref, atol):
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.cpu().float() / scale, ref / scale, atol=atol, rtol=0)


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_bias_and_clamp_match_reference(T, A, E, D, I):
    hidden, ids, weights, banks, bias = case(T, A, E, D, I, seed=T + D, device=kernel_device(), mx=False)
    got = moe_gemv(hidden, ids, weights, *banks, act=ACT, bias=bias)
    ref = reference(hidden, ids, weights, banks, bias)
    assert_close(got, ref, atol=1e-5)
    plain = moe_reference(hidden.cpu(), ids.cpu(), weights.cpu(), *(b.cpu() for b in banks))
    assert not torch.allclose(ref, plain, atol=1e-3)  # the case exercises the bias / clamp at all


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_mxfp4_matches_reference(T, A, E, D, I):
    hidden, ids, weights, banks, bias = case(T, A, E, D, I, seed=T + I, device=kernel_device())
    gate_up, down, gs, ds = banks
    assert_close(moe_gemv(hidden, ids, weights, gate_up, down, gs, ds, act=ACT, bias=bias),
                 reference(hidden, ids, weights, banks, bias), atol=2e-5)
    # without the gpt-oss math too (plain SwiGLU, no biases): the format is independent of the experts' maths
    dense_gu, dense_d = dense(gate_up, gs), dense(down, ds)
    assert_close(moe_gemv(hidden, ids, weights, gate_up, down, gs, ds),
                 moe_reference(hidden.cpu(), ids.cpu(), weights.cpu(), dense_gu, dense_d), atol=2e-5)


def test_mxfp4_hand_computed_values():
    """Values written out by hand, not through models/mxfp4: byte j of a row holds element 2j in its low
    nibble, 2j+1 in its high one; scale s means 2**(s - 127); nibble 0b1001 is -0.5 (sign bit 3, subnormal)."""
    D = I = 32
    dev = kernel_device()
    gate_up = torch.zeros(1, 2 * I, D // 2, dtype=torch.uint8)
    down = torch.zeros(1, D, I // 2, dtype=torch.uint8)
    gate_up[0, 0, 0] = 0x7A  # gate row 0: element 0 = -1.0 (0xA), element 1 = +6.0 (0x7)
    gate_up[0, 0, 3] = 0x09  # element 6 = -0.5, element 7 = 0
    gate_up[0, I, 0] = 0x20  # up row 0: element 1 = +1.0
    down[0, 5, 0] = 0x04  # down row 5: element 0 = +2.0
    gs = torch.full((1, 2 * I, 1), 127, dtype=torch.uint8)
    gs[0, 0, 0] = 126  # gate row 0 scaled by 1/2
    ds = torch.full((1, D, 1), 129, dtype=torch.uint8)  # x4
    x = torch.zeros(1, D)
    x[0, 0], x[0, 1], x[0, 6], x[0, 7] = 1.0, 0.25, 2.0, 100.0
    gate = 0.5 * (-1.0 * 1.0 + 6.0 * 0.25 - 0.5 * 2.0)  # -0.25
    up = 1.0 * 0.25
    act = gate / (1 + torch.exp(torch.tensor(-gate))) * up  # silu(gate) * up
    want = torch.zeros(1, D)
    want[0, 5] = 4 * 2.0 * act
    args = [t.to(dev) for t in (x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), gate_up, down, gs, ds)]
    torch.testing.assert_close(moe_gemv(*args).cpu(), want, atol=1e-7, rtol=1e-6)


def test_mismatched_mxfp4_scales_are_refused():
    hidden, ids, weights, (gate_up, down, gs, ds), bias = case(1, 1, 2, 64, 32, seed=0, device=kernel_device())
    with pytest.raises(ValueError, match="mxfp4 scales"):
        moe_gemv(hidden, ids, weights, gate_up, down, gs[:, :, :1], ds)
    with pytest.raises(ValueError, match="biases"):
        moe_gemv(hidden, ids, weights, gate_up, down, gs, ds, act=ACT, bias=(bias[0][:, :8], bias[1]))


@pytest.mark.parametrize("mx", [False, True])
@pytest.mark.parametrize("T", [1, 40])  # the GEMV (R = 2) and the grouped GEMM (R = 80 > GEMV_MAX_ROUTES)
def test_decode_kernel_runs_gpt_oss_experts_on_the_triton_kernels(T, mx):
    """resident's DecodeKernel hands the clamped SwiGLU, the biases and MXFP4 banks to the Triton kernels (no
    torch fallback)."""
    from services.engine.moe.banks import ExpertFormat
    from services.engine.moe.resident import DecodeKernel

    hidden, ids, weights, banks, bias = case(T, 2, 8, 64, 32, seed=5, device=kernel_device(), mx=mx)
    kernel = DecodeKernel("triton")
    fmt = ExpertFormat.MXFP4 if mx else ExpertFormat.UNQUANTIZED
    got = kernel(hidden, ids, weights, banks[0], banks[1], ACT, bias, *banks[2:], fmt=fmt)
    assert kernel.kind == "triton"
    assert_close(got, reference(hidden, ids, weights, banks, bias), atol=1e-5)


GPU_CASES = CASES + [(1, 4, 32, 2880, 2880), (8, 4, 32, 2880, 2880)]  # gpt-oss-120b's D and I


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mx", [True, False])
@pytest.mark.parametrize("T, A, E, D, I", GPU_CASES)
def test_bf16_on_gpu_matches_reference(T, A, E, D, I, mx):
    hidden, ids, weights, banks, bias = case(T, A, E, D, I, seed=1, device="cuda", dtype=torch.bfloat16, mx=mx)
    got = moe_gemv(hidden, ids, weights, *banks, act=ACT, bias=bias)
    assert_close(got, reference(hidden, ids, weights, banks, bias), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mx", [True, False])
def test_cuda_graph_replay(mx):
    hidden, ids, weights, banks, bias = case(1, 4, 32, 2880, 2880, seed=2, device="cuda", dtype=torch.bfloat16, mx=mx)
    moe_gemv(hidden, ids, weights, *banks, act=ACT, bias=bias)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(hidden, ids, weights, *banks, act=ACT, bias=bias)
    new = case(1, 4, 32, 2880, 2880, seed=3, device="cuda", dtype=torch.bfloat16, mx=mx)
    for old, fresh in zip((hidden, ids, weights), new[:3]):
        old.copy_(fresh)
    graph.replay()
    assert_close(out, reference(hidden, ids, weights, banks, bias), atol=1e-2)

"""kernels/moe_gemv and kernels/moe_gemm on GGUF banks (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf; gate_up and down of
different types as in Q4_K_M files) against the torch reference: services/engine/moe/gguf_quant.dequantize
(itself bit-equal to gguf-py) + moe_reference. Banks are gguf_quant.quantize of random weights, every block
valid; plain SwiGLU and gpt-oss's biases + clamped SwiGLU; skipped routes; rows padded past their type's
bytes with junk (slots shared by layers of different types) must give the same result. fp32 under the interpreter (tiny
shapes), bf16 and CUDA-graph replay on the GPU (marked gpu: the lead runs them on the H200)."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemm import GemmConfig, all_configs, moe_gemm
from kernels.moe_gemv import RowLaunch, moe_gemv, row_alignment
from services.engine.moe.gguf_quant import BLOCK, GGUFType, dequantize, quantize, row_bytes
from services.engine.moe.reference import ClampedSwiGLU, moe_reference
from tests.kernels.conftest import kernel_device

Q4, Q5, Q6, Q8, MX = GGUFType.Q4_K, GGUFType.Q5_K, GGUFType.Q6_K, GGUFType.Q8_0, GGUFType.MXFP4
ACT = ClampedSwiGLU()
SMALL = GemmConfig(16, 16, 32, 16, 32, num_warps=4, num_stages=2)  # many tiles and k-steps, the per-value decode
SMALL64 = GemmConfig(16, 16, 64, 16, 128, num_warps=4, num_stages=2)  # q4_K / q5_K's 64-value groups
CASES = [  # gate_up type, down type, T, A, E, D, I
    (Q4, Q6, 1, 2, 3, 256, 256),  # Q4_K_M's pair
    (Q5, Q8, 3, 2, 4, 512, 256),  # two K-quant blocks a row of gate_up
    (Q6, Q4, 2, 2, 3, 256, 256),
    (Q8, MX, 3, 2, 5, 64, 96),  # 32-value blocks: D and I below one 256-wide k-step
    (MX, Q8, 1, 1, 2, 96, 32),
]


def gguf_case(gt, dt, T, A, E, D, I, seed, device, dtype=torch.float32):
    """Random experts quantized to (gt, dt): (hidden, ids, weights, gate_up, down, bias) on ``device``."""
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize(torch.randn(E, 2 * I, D, generator=g) * 2 / D ** 0.5, gt)  # [E, 2I, row_bytes(D)]
    down = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5, dt)  # [E, D, row_bytes(I)]
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    skip = torch.rand(T, A, generator=g) < 0.25
    skip[0, 0] = False  # at least one route computed
    ids[skip] = -1
    weights = torch.rand(T, A, generator=g)
    bias = (torch.randn(E, 2 * I, generator=g), torch.randn(E, D, generator=g) * 0.1)
    to = lambda t: t.to(device)  # noqa: E731
    return (to(hidden.to(dtype)), to(ids), to(weights), to(gate_up), to(down), tuple(to(b.to(dtype)) for b in bias))


def reference(hidden, ids, weights, gate_up, down, gt, dt, act=None, bias=None):
    D, I = down.shape[1], gate_up.shape[1] // 2
    gu, d = dequantize(gate_up.cpu(), gt, D), dequantize(down.cpu(), dt, I)
    return moe_reference(hidden.cpu().float(), ids.cpu(), weights.cpu(), gu, d, act,
                         None if bias is None else tuple(b.cpu().float() for b in bias))


def assert_close(out, ref, atol):
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.cpu().float() / scale, ref / scale, atol=atol, rtol=0)


@pytest.mark.parametrize("gt, dt, T, A, E, D, I", CASES)
def test_gemv_matches_reference(gt, dt, T, A, E, D, I):
    hidden, ids, weights, gate_up, down, bias = gguf_case(gt, dt, T, A, E, D, I, seed=T + I, device=kernel_device())
    assert gate_up.shape[2] == row_bytes(gt, D) and down.shape[2] == row_bytes(dt, I)
    got = moe_gemv(hidden, ids, weights, gate_up, down, gguf_types=(gt, dt))
    assert_close(got, reference(hidden, ids, weights, gate_up, down, gt, dt), atol=2e-5)


@pytest.mark.parametrize("gt, dt, T, A, E, D, I", CASES[::2])
def test_gemv_gpt_oss_math_matches_reference(gt, dt, T, A, E, D, I):
    hidden, ids, weights, gate_up, down, bias = gguf_case(gt, dt, T, A, E, D, I, seed=5, device=kernel_device())
    got = moe_gemv(hidden, ids, weights, gate_up, down, act=ACT, bias=bias, gguf_types=(gt.value, dt.value))
    assert_close(got, reference(hidden, ids, weights, gate_up, down, gt, dt, ACT, bias), atol=2e-5)


GEMM_CASES = [case if case[5] <= 256 else (*case[:5], 256, case[6]) for case in CASES]  # the interpreter's time


@pytest.mark.parametrize("gt, dt, T, A, E, D, I", GEMM_CASES)
def test_gemm_matches_reference(gt, dt, T, A, E, D, I):
    T = T * 3  # several routes per expert: tiles of more than one row
    hidden, ids, weights, gate_up, down, bias = gguf_case(gt, dt, T, A, E, D, I, seed=T, device=kernel_device())
    ref = reference(hidden, ids, weights, gate_up, down, gt, dt)
    for cfg in (SMALL, SMALL64) if {gt, dt} & {Q4, Q5, Q6} else (SMALL,):
        assert_close(moe_gemm(hidden, ids, weights, gate_up, down, config=cfg, gguf_types=(gt, dt)), ref, atol=2e-5)


def test_gemm_gpt_oss_math_and_table_configs():
    hidden, ids, weights, gate_up, down, bias = gguf_case(Q4, Q6, 6, 2, 3, 256, 256, seed=9, device=kernel_device())
    ref = reference(hidden, ids, weights, gate_up, down, Q4, Q6, ACT, bias)
    for cfg in [SMALL, *all_configs(hidden.device)]:
        assert_close(moe_gemm(hidden, ids, weights, gate_up, down, ACT, bias, config=cfg, gguf_types=(Q4, Q6)), ref,
                     atol=2e-5)


def pad_rows(bank: torch.Tensor, extra: int) -> torch.Tensor:
    """``bank`` with ``extra`` junk bytes (0xFF: NaN fp16 scales if read) after each row's blocks."""
    junk = torch.full((*bank.shape[:2], extra), 0xFF, dtype=torch.uint8, device=bank.device)
    return torch.cat([bank, junk], dim=2)


def test_padded_rows_read_only_their_types_bytes():
    """A q4_K+q4_K layer in slots sized for q4_K+q6_K (the widest rows of a Q4_K_M file): same result as unpadded."""
    hidden, ids, weights, gate_up, down, _ = gguf_case(Q4, Q4, 8, 2, 2, 256, 256, seed=4, device=kernel_device())
    ref = reference(hidden, ids, weights, gate_up, down, Q4, Q4)
    gate_up, down = pad_rows(gate_up, 16), pad_rows(down, row_bytes(Q6, 256) - row_bytes(Q4, 256))
    assert_close(moe_gemv(hidden[:1], ids[:1], weights[:1], gate_up, down, gguf_types=(Q4, Q4)),
                 reference(hidden[:1], ids[:1], weights[:1], gate_up, down, Q4, Q4), atol=2e-5)
    for cfg in (SMALL, SMALL64):
        assert_close(moe_gemm(hidden, ids, weights, gate_up, down, config=cfg, gguf_types=(Q4, Q4)), ref, atol=2e-5)


@pytest.mark.parametrize("gt, dt, extra, aligns", [
    (Q4, Q6, 2, (2, 4)),  # q4_K rows 2 bytes past a multiple of 4 (as q4_K down in q6_K-wide slots of I=768: 630)
    (Q5, Q4, 1, (1, 1)),  # odd row strides: byte loads
    (Q6, Q5, 1, (1, 1)),
    (Q4, Q5, 4, (4, 4)),
])
def test_gemv_reads_rows_at_each_alignment(gt, dt, extra, aligns):
    """Padded rows whose strides allow 32-bit, 16-bit or only byte loads (the launcher's row_alignment): same
    result as the reference, also at launches other than the table's (one with rows past the bank's end)."""
    hidden, ids, weights, gate_up, down, _ = gguf_case(gt, dt, 2, 2, 3, 256, 256, seed=extra, device=kernel_device())
    ref = reference(hidden, ids, weights, gate_up, down, gt, dt)
    gate_up, down = pad_rows(gate_up, extra), pad_rows(down, extra)
    assert (row_alignment(gate_up), row_alignment(down)) == aligns
    assert_close(moe_gemv(hidden, ids, weights, gate_up, down, gguf_types=(gt, dt)), ref, atol=2e-5)
    launch = (RowLaunch(8, num_warps=2), RowLaunch(512, num_warps=1))  # kernel 2: one program, half its rows masked
    assert_close(moe_gemv(hidden, ids, weights, gate_up, down, gguf_types=(gt, dt), gguf_launch=launch), ref,
                 atol=2e-5)


@pytest.mark.parametrize("dtype, offset", [(torch.bfloat16, 0), (torch.float16, 0), (torch.bfloat16, 1)])
def test_gemv_16_bit_inputs(dtype, offset):
    """bf16 / fp16 hidden: four inputs a 64-bit load when rows start at multiples of 8 bytes, one load each
    when not (``offset`` elements into a buffer). Against the reference on the same rounded inputs."""
    hidden, ids, weights, gate_up, down, _ = gguf_case(Q4, Q6, 2, 2, 3, 256, 256, seed=6, device=kernel_device(),
                                                       dtype=dtype)
    shifted = torch.empty(hidden.numel() + offset, dtype=dtype, device=hidden.device)[offset:].view(hidden.shape)
    shifted.copy_(hidden)
    assert (shifted.data_ptr() % 8 == 0) == (offset == 0)
    got = moe_gemv(shifted, ids, weights, gate_up, down, gguf_types=(Q4, Q6))
    assert_close(got, reference(hidden, ids, weights, gate_up, down, Q4, Q6), atol=1e-2)  # the output's rounding


def test_row_alignment_sees_the_address_and_both_strides():
    bank = torch.zeros(2, 4, 160, dtype=torch.uint8)
    assert row_alignment(bank) == 4
    assert row_alignment(bank[:, :, 2:]) == 2  # a view 2 bytes into each row
    assert row_alignment(bank[:, :, 1:]) == 1
    assert row_alignment(bank[:, ::3]) == 4  # row stride 480
    assert row_alignment(torch.zeros(3, 2, 105, dtype=torch.uint8)) == 1  # expert stride 210, row stride 105


def test_banks_that_do_not_fit_their_types_are_refused():
    hidden, ids, weights, gate_up, down, _ = gguf_case(Q8, Q8, 1, 1, 2, 64, 32, seed=0, device=kernel_device())
    with pytest.raises(ValueError, match=r"moe_gemv: GGUF banks .* q8_0 bank .* not uint8 \[E, 64, >= 68\]"):
        moe_gemv(hidden, ids, weights, gate_up[:, :, :-2], down, gguf_types=(Q8, Q8))
    with pytest.raises(ValueError, match=r"moe_gemm: GGUF banks .* q6_K: a row of 32 values"):
        moe_gemm(hidden, ids, weights, gate_up, down, gguf_types=(Q8, Q6))  # I = 32: not a q6_K row
    with pytest.raises(ValueError, match=r"not uint8 \[E, 64, "):
        moe_gemv(hidden, ids, weights, gate_up, down[:, :32], gguf_types=("q8_0", "q8_0"))
    with pytest.raises(ValueError, match="without scales are GGUF banks: pass gguf_types"):  # uint8 without scales or types: not guessed
        moe_gemv(hidden, ids, weights, gate_up, down)


# -- on the GPU (the lead's H200): real widths, bf16, CUDA-graph replay --------------------------------------
GPU_PAIRS = [(Q4, Q6), (Q5, Q5), (Q6, Q6), (Q8, Q8), (MX, MX), (Q4, Q4)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("gt, dt", GPU_PAIRS)
@pytest.mark.parametrize("T", [1, 2, 16, 200])
def test_bf16_on_gpu(gt, dt, T):
    """Qwen3-30B-A3B's D and I (2048, 768) at 32 experts, top-8: the GEMV and the GEMM against the reference."""
    hidden, ids, weights, gate_up, down, _ = gguf_case(gt, dt, T, 8, 32, 2048, 768, seed=T, device="cuda",
                                                       dtype=torch.bfloat16)
    ref = reference(hidden, ids, weights, gate_up, down, gt, dt)
    assert_close(moe_gemm(hidden, ids, weights, gate_up, down, gguf_types=(gt, dt)), ref, atol=1e-2)
    if T <= 2:
        assert_close(moe_gemv(hidden, ids, weights, gate_up, down, gguf_types=(gt, dt)), ref, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpt_oss_mxfp4_gguf_on_gpu():
    """gpt-oss-120b's GGUF geometry (D = I = 2880: 90 mxfp4 blocks a row) with its biases and clamp."""
    hidden, ids, weights, gate_up, down, bias = gguf_case(MX, MX, 8, 4, 16, 2880, 2880, seed=1, device="cuda",
                                                          dtype=torch.bfloat16)
    ref = reference(hidden, ids, weights, gate_up, down, MX, MX, ACT, bias)
    assert_close(moe_gemm(hidden, ids, weights, gate_up, down, ACT, bias, gguf_types=(MX, MX)), ref, atol=1e-2)
    assert_close(moe_gemv(hidden[:1], ids[:1], weights[:1], gate_up, down, act=ACT, bias=bias, gguf_types=(MX, MX)),
                 reference(hidden[:1], ids[:1], weights[:1], gate_up, down, MX, MX, ACT, bias), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 32])
def test_cuda_graph_replay(T):
    """Captured once, replayed on new inputs (GEMV at T=1, GEMM at T=32): no host sync, fixed shapes."""
    hidden, ids, weights, gate_up, down, _ = gguf_case(Q4, Q6, T, 8, 32, 2048, 768, seed=2, device="cuda",
                                                       dtype=torch.bfloat16)
    fn = moe_gemv if T == 1 else moe_gemm
    fn(hidden, ids, weights, gate_up, down, gguf_types=(Q4, Q6))  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(hidden, ids, weights, gate_up, down, gguf_types=(Q4, Q6))
    new = gguf_case(Q4, Q6, T, 8, 32, 2048, 768, seed=3, device="cuda", dtype=torch.bfloat16)
    for old, fresh in zip((hidden, ids, weights), new[:3]):
        old.copy_(fresh)
    graph.replay()
    assert_close(out, reference(hidden, ids, weights, gate_up, down, Q4, Q6), atol=1e-2)

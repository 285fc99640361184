"""CPU executor on mxfp4 banks against the torch reference (models/mxfp4.py dequantize, itself bit-equal
to transformers', + moe_reference), for every ISA this CPU has (AVX-512's vpermps table and the scalar
one).

Weights are random bytes (every e2m1 code in both nibbles, both signs) with random E8M0 scales over a
spread of exponents, plain SwiGLU and gpt-oss's (biases, clamp at 7 that bites). Shapes: one block, rows
of several blocks, gate rows of one expert split across workers, batches with repeated experts. Two
exact cases fail on a swapped nibble order or a wrong exponent bias, whatever the tolerance."""

from __future__ import annotations

import pytest
import torch

from services.engine.models import mxfp4
from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.cpu_executor import CpuExecutor, build_extension
from services.engine.moe.reference import ClampedSwiGLU, moe_reference

SHAPES = [  # T, A, E, D, I
    (1, 1, 1, 32, 32),  # one block each way
    (1, 4, 8, 96, 64),  # decode, rows of 3 and 2 blocks
    (5, 3, 6, 64, 160),  # a batch with repeated experts, gate rows split across the 3 workers
    (3, 2, 3, 320, 32),
]
ISAS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar") if build_extension().select_isa(isa)]
ACT = ClampedSwiGLU(1.702, 7.0)


def mxfp4_case(T, A, E, D, I, seed=0, gpt_oss=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    banks = ExpertBanks.allocate(ExpertFormat.MXFP4, 1, E, D, I, dtype, bias=gpt_oss, activation=ACT if gpt_oss else None)
    L = banks.layers[0].tensors
    for name in ("gate_up", "down"):
        L[name].copy_(torch.randint(0, 256, L[name].shape, generator=g, dtype=torch.int32).to(torch.uint8))
    # e2m1 values up to 6 over 2^-6..2^-2: products of a few x 0.1 per value, the clamp at 7 reached sometimes
    L["gate_up_scale"].copy_(torch.randint(121, 126, L["gate_up_scale"].shape, generator=g, dtype=torch.int32))
    L["down_scale"].copy_(torch.randint(118, 124, L["down_scale"].shape, generator=g, dtype=torch.int32))
    if gpt_oss:
        L["gate_up_bias"].copy_(torch.randn(L["gate_up_bias"].shape, generator=g))
        L["down_bias"].copy_(torch.randn(L["down_bias"].shape, generator=g) * 0.1)
    hidden = torch.randn(T, D, generator=g)  # [T, D]
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A]
    ids[torch.rand(T, A, generator=g) < 0.2] = -1
    ids[0, 0] = 0  # at least one route
    weights = torch.rand(T, A, generator=g)
    return banks, hidden, ids, weights


def reference(banks, hidden, ids, weights):
    L = banks.layers[0].tensors
    gate_up, down = mxfp4.dense_experts(L["gate_up"], L["down"], L["gate_up_scale"], L["down_scale"], torch.float32)
    bias = None if banks.layers[0].bias is None else tuple(b.float() for b in banks.layers[0].bias)
    return moe_reference(hidden.float(), ids, weights, gate_up, down, banks.activation, bias)


def run(banks, hidden, ids, weights, isa):
    ex = CpuExecutor(banks, num_threads=3, spin_us=50, isa=isa)
    try:
        return ex.forward(0, hidden, ids, weights)
    finally:
        ex.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}A{}E{}D{}I{}".format(*s))
def test_mxfp4_matches_reference(shape, gpt_oss, isa):
    banks, hidden, ids, weights = mxfp4_case(*shape, seed=sum(shape), gpt_oss=gpt_oss)
    out = run(banks, hidden, ids, weights, isa)
    ref = reference(banks, hidden, ids, weights)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out / scale, ref / scale, atol=2e-5, rtol=0)


def test_the_clamp_bites_in_the_gpt_oss_cases():
    banks, hidden, ids, weights = mxfp4_case(*SHAPES[2], seed=sum(SHAPES[2]), gpt_oss=True)
    L = banks.layers[0].tensors
    gate_up = mxfp4.dequantize_rows(L["gate_up"], L["gate_up_scale"])
    assert (hidden @ gate_up[ids[0, 0]].t() + L["gate_up_bias"][ids[0, 0]]).abs().max() > 7


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}A{}E{}D{}I{}".format(*s))
def test_mxfp4_bf16_model(shape, isa):
    """A bf16 model: bf16 activations and bias banks beside the MXFP4 bytes. With AVX-512-BF16 the
    bf16-input kernel runs (vdpbf16ps: exact products, the SwiGLU output rounded to bf16 as on the GPU;
    pairs of blocks and a lone last block, D = 96 and I = 160 have one), elsewhere the fp32 one (exact)."""
    banks, hidden, ids, weights = mxfp4_case(*shape, seed=5 + sum(shape), gpt_oss=True, dtype=torch.bfloat16)
    L = banks.layers[0].tensors
    assert L["gate_up_bias"].dtype == torch.bfloat16 and L["gate_up"].dtype == torch.uint8
    hidden = hidden.bfloat16()
    out = run(banks, hidden, ids, weights, isa)
    ref = reference(banks, hidden, ids, weights)
    scale = ref.abs().max().item()
    atol = 1e-2 if isa == "avx512bf16" else 2e-5  # bf16 rounding of the SwiGLU output: ~2^-9 relative
    torch.testing.assert_close(out / scale, ref / scale, atol=atol, rtol=0)


def test_bf16_input_kernel_layout_is_exact():
    """The bf16-input kernel on inputs exact in bf16 and an identity-like down: one gate value per row
    (every e2m1 code, both nibbles, pairs of blocks and a lone last one) must come out bit-exact."""
    if "avx512bf16" not in ISAS:
        pytest.skip("this CPU has no AVX-512-BF16 (the fp32-input kernel is checked above)")
    D, I = 96, 32
    banks = ExpertBanks.allocate(ExpertFormat.MXFP4, 1, 1, D, I, torch.bfloat16)
    L = banks.layers[0].tensors
    g = torch.Generator().manual_seed(9)
    L["gate_up"].copy_(torch.randint(0, 256, L["gate_up"].shape, generator=g, dtype=torch.int32))
    L["gate_up_scale"].fill_(127)
    L["down"].zero_()
    L["down"][0, :, 0] = 0x02  # down[:, 0] = 1
    L["down_scale"].fill_(127)
    gate_up = mxfp4.dequantize_rows(L["gate_up"], L["gate_up_scale"])  # [1, 2I, D]
    for k in range(D):  # hidden = e_k reads column k of every gate / up row: each position of the layout
        hidden = torch.zeros(1, D, dtype=torch.bfloat16)
        hidden[0, k] = 1.0
        out = run(banks, hidden, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), "avx512bf16")
        gate, up = gate_up[0, 0, k], gate_up[0, I, k]
        act = (torch.nn.functional.silu(gate) * up).bfloat16().float()
        assert torch.equal(out[0], torch.full((D,), act.item())), k


def one_value_banks(byte: int, scale: int) -> ExpertBanks:
    """One expert, D = I = 32, every weight 0 but: gate row 0's byte 0 = ``byte`` under E8M0 ``scale``, up
    row 0 all 1.0, down column 0 all 1.0 (scales 2^0)."""
    banks = ExpertBanks.allocate(ExpertFormat.MXFP4, 1, 1, 32, 32, torch.float32)
    L = banks.layers[0].tensors
    for t in L.values():
        t.zero_()
    L["gate_up"][0, 0, 0] = byte
    L["gate_up_scale"][0, 0, 0] = scale
    L["gate_up_scale"][0, 32:, :] = 127
    L["gate_up"][0, 32, :] = 0x22  # up row 0: every value 1.0 (code 2 in both nibbles)
    L["down"][0, :, 0] = 0x02  # down[:, 0] = 1.0 (low nibble of byte 0 = element 0), scale 2^0
    L["down_scale"][0] = 127
    return banks


@pytest.mark.parametrize("isa", ISAS)
def test_nibble_order_and_exponent_bias_are_exact(isa):
    """Byte 0 of gate row 0 = 0x70: element 0 (low nibble) is 0, element 1 (high nibble) is code 7 = 6.0;
    scale byte 130 = 2^3. With hidden = e_1 the gate is exactly 48 (a swapped nibble order gives 0, a bias
    of 128 gives 24); with hidden = e_0 it is 0. Output = down[:, 0] * silu(gate) * up, up = sum(hidden)."""
    banks = one_value_banks(0x70, 130)
    ids, w = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1)
    for k, gate in ((1, 48.0), (0, 0.0)):
        hidden = torch.zeros(1, 32)
        hidden[0, k] = 1.0
        out = run(banks, hidden, ids, w, isa)
        expect = torch.nn.functional.silu(torch.tensor(gate)) * 1.0
        assert torch.equal(out[0], torch.full((32,), expect.item())), (k, out[0, :4])
        assert torch.equal(out, reference(banks, hidden, ids, w))


def test_e8m0_bytes_are_not_taken_as_fp8_scales():
    """The executor reads scale banks by the weights' format: E8M0 bytes beside fp8 weights, or fp32 scales
    beside mxfp4 bytes, are refused with the layout each format needs."""
    banks, hidden, ids, weights = mxfp4_case(1, 1, 1, 32, 32)
    L = banks.layers[0].tensors
    ex = CpuExecutor(banks, num_threads=1, spin_us=50, isa=ISAS[-1])
    out = torch.empty(1, 32)
    try:
        with pytest.raises(RuntimeError, match=r"come with two scale banks"):
            ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"]], out, torch.empty(0), 0)
        with pytest.raises(RuntimeError, match=r"mxfp4 gate_up_scale must be contiguous uint8 \(E8M0\)"):
            ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"], L["gate_up_scale"].float(),
                                                   L["down_scale"].float()], out, torch.empty(0), 0)
        fp8 = ExpertBanks.allocate(ExpertFormat.FP8_BLOCK, 1, 1, 32, 32, torch.float32).layers[0].tensors
        with pytest.raises(RuntimeError, match=r"gate_up_scale must be contiguous fp32"):
            ex._impl.submit(hidden, ids, weights, [fp8["gate_up"], fp8["down"], L["gate_up_scale"], L["down_scale"]],
                            out, torch.empty(0), 0)
    finally:
        ex.close()


def test_loop_counts_mxfp4_bytes():
    """Loop mode's byte counter (what bench_cpu_executor's GB/s divides) counts packed bytes and scales."""
    banks, hidden, ids, weights = mxfp4_case(1, 2, 4, 64, 32, seed=3)
    ex = CpuExecutor(banks, num_threads=2, spin_us=50, isa=ISAS[0])
    try:
        ids = torch.tensor([[[0, 1]]])  # [N=1, T=1, A=2]: two experts per job
        ex.start_loop(hidden, ids, weights)
        jobs, nbytes, _ = ex.stop_loop()
    finally:
        ex.close()
    assert jobs >= 1 and nbytes == jobs * 2 * banks.expert_nbytes()


def test_gpt_oss_120b_width_bf16_model():
    """gpt-oss-120b's expert shape (D = I = 2880: 45 block pairs a row, no lone block) in a bf16 model, one
    decode token over top-4 with biases and the clamp, on this CPU's best kernel: within bf16 rounding of
    the reference (the H200's hybrid graph check failure on this model was not the executor's)."""
    banks, hidden, ids, weights = mxfp4_case(1, 4, 6, 2880, 2880, seed=11, gpt_oss=True, dtype=torch.bfloat16)
    ids[0] = torch.tensor([5, 0, 3, 1])  # all four routes valid
    hidden = hidden.bfloat16()
    out = run(banks, hidden, ids, weights, ISAS[0])
    ref = reference(banks, hidden, ids, weights)
    scale = ref.abs().max().item()
    atol = 1e-2 if ISAS[0] == "avx512bf16" else 2e-5
    torch.testing.assert_close(out / scale, ref / scale, atol=atol, rtol=0)

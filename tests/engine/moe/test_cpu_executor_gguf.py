"""CPU executor on GGUF banks (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf; gate_up and down of different types as in
Q4_K_M files) against the torch reference (services/engine/moe/gguf_quant.dequantize, itself bit-equal to
gguf-py, + moe_reference), for every ISA this CPU has (the AVX-512 kernel and the scalar one).

Banks are gguf_quant.quantize of random weights (valid blocks); plain SwiGLU and gpt-oss's (biases, clamp);
shapes of one block, rows of several blocks, gate rows of one expert split across workers, batches with
repeated experts; fp32 and bf16 models. A bf16 model's layers run an int8-input kernel (AVX512-VNNI, or AVX2
where the CPU has no VNNI): its reference sees the inputs as gguf_quant.q8_inputs rounds them."""

from __future__ import annotations

import pytest
import torch

from services.engine.moe.banks import ExpertBanks, LayerBanks
from services.engine.moe.cpu_executor import CpuExecutor, build_extension
from services.engine.moe.gguf_quant import BLOCK, KERNEL_CODE, GGUFType, dequantize, q8_inputs, quantize, row_bytes
from services.engine.moe.reference import ClampedSwiGLU, moe_reference

Q4, Q5, Q6, Q8, MX = GGUFType.Q4_K, GGUFType.Q5_K, GGUFType.Q6_K, GGUFType.Q8_0, GGUFType.MXFP4
CASES = [  # gate_up type, down type, T, A, E, D, I
    (Q4, Q6, 1, 4, 8, 256, 256),  # Q4_K_M's pair, decode
    (Q5, Q8, 5, 3, 6, 256, 512),  # repeated experts; down rows of 16 q8_0 blocks
    (Q6, Q4, 3, 2, 3, 512, 256),
    (Q8, MX, 1, 1, 1, 32, 32),  # one block each way
    (MX, Q5, 4, 2, 3, 64, 256),
    (Q4, Q4, 2, 2, 2, 256, 256),
    (Q4, Q6, 19, 1, 1, 256, 256),  # ~15 tokens on one expert: token passes of 8 and of the rest
    (Q8, MX, 14, 2, 2, 64, 64),
]
ISAS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar") if build_extension().select_isa(isa)]
ACT = ClampedSwiGLU(1.702, 7.0)


class GgufLayer(LayerBanks):
    """A GGUF layer whatever BANK_SCHEMAS holds: its format is the GGUF format's value ("q4_K+q6_K"), which
    names the banks' types (gguf_quant.format_types: what CpuExecutor hands the extension), and ordered()
    gives [gate_up, down] as the GGUF schemas do."""

    def ordered(self) -> list[torch.Tensor]:
        return [self.tensors["gate_up"], self.tensors["down"]]


def layer(gt, dt, tensors) -> GgufLayer:
    return GgufLayer(f"{gt.value}+{dt.value}", tensors)


def pad_rows(bank: torch.Tensor, extra: int) -> torch.Tensor:
    """``bank`` with ``extra`` junk bytes (0xFF: NaN fp16 scales if read) after each row's blocks."""
    return torch.cat([bank, torch.full((*bank.shape[:2], extra), 0xFF, dtype=torch.uint8)], dim=2)


def gguf_case(gt, dt, T, A, E, D, I, seed=0, gpt_oss=False, dtype=torch.float32, pad=0):
    """One layer of GGUF banks (rows padded by ``pad`` junk bytes: slots shared with wider types) and a
    step's inputs."""
    g = torch.Generator().manual_seed(seed)
    gate_up = quantize(torch.randn(E, 2 * I, D, generator=g) * 3 / D ** 0.5, gt)  # [E, 2I, row_bytes(D)]
    down = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5, dt)  # [E, D, row_bytes(I)]
    tensors = {"gate_up": pad_rows(gate_up, pad), "down": pad_rows(down, pad)}
    if gpt_oss:
        tensors["gate_up_bias"] = torch.randn(E, 2 * I, generator=g).to(dtype)
        tensors["down_bias"] = (torch.randn(E, D, generator=g) * 0.1).to(dtype)
    banks = ExpertBanks([layer(gt, dt, tensors)], ACT if gpt_oss else None)
    hidden = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    ids[torch.rand(T, A, generator=g) < 0.2] = -1
    ids[0, 0] = 0  # at least one route
    weights = torch.rand(T, A, generator=g)
    return banks, hidden, ids, weights




def has_int8_input_kernel(isa: str) -> bool:
    ex = CpuExecutor(ExpertBanks([layer(Q4, Q4, {"gate_up": quantize(torch.zeros(1, 512, 256), Q4),
                                                 "down": quantize(torch.zeros(1, 256, 256), Q4)})]),
                     num_threads=1, spin_us=50, isa=isa)
    try:
        return ex.gguf_q8_inputs
    finally:
        ex.close()


Q8_ISAS = [isa for isa in ISAS if has_int8_input_kernel(isa)]


def reference(banks, hidden, ids, weights, gt, dt, inputs=None):
    L = banks.layers[0].tensors
    bias = None if banks.layers[0].bias is None else tuple(b.float() for b in banks.layers[0].bias)
    D, I = L["down"].shape[1], L["gate_up"].shape[1] // 2
    return moe_reference(hidden.float(), ids, weights, dequantize(L["gate_up"], gt, D), dequantize(L["down"], dt, I),
                         banks.activation, bias, inputs)


def run(banks, hidden, ids, weights, isa, threads=3):
    ex = CpuExecutor(banks, num_threads=threads, spin_us=50, isa=isa)
    try:
        return ex.forward(0, hidden, ids, weights)
    finally:
        ex.close()


def assert_close(out, ref, atol=2e-5):
    scale = ref.abs().max().item()
    torch.testing.assert_close(out / scale, ref / scale, atol=atol, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("gt, dt, T, A, E, D, I", CASES, ids=lambda v: getattr(v, "value", str(v)))
def test_gguf_matches_reference(gt, dt, T, A, E, D, I, isa):
    banks, hidden, ids, weights = gguf_case(gt, dt, T, A, E, D, I, seed=T + D)
    L = banks.layers[0].tensors
    assert L["gate_up"].shape[2] == row_bytes(gt, D) and L["down"].shape[2] == row_bytes(dt, I)
    assert_close(run(banks, hidden, ids, weights, isa), reference(banks, hidden, ids, weights, gt, dt))


@pytest.mark.parametrize("isa", ISAS)
def test_padded_rows_read_only_their_types_bytes(isa):
    """A q4_K layer in slots as wide as q6_K rows (a Q4_K_M file's widest): junk past the blocks is not read."""
    banks, hidden, ids, weights = gguf_case(Q4, Q4, 3, 2, 4, 256, 256, seed=2, pad=row_bytes(Q6, 256) - row_bytes(Q4, 256))
    assert_close(run(banks, hidden, ids, weights, isa), reference(banks, hidden, ids, weights, Q4, Q4))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gguf_gpt_oss_math(isa, dtype):
    """Biases (in the model dtype) and the clamped SwiGLU beside mxfp4_gguf banks, as gpt-oss GGUF files hold them."""
    banks, hidden, ids, weights = gguf_case(MX, MX, 3, 4, 6, 96, 64, seed=4, gpt_oss=True, dtype=dtype)
    ex = CpuExecutor(banks, num_threads=3, spin_us=50, isa=isa)
    try:
        inputs = ex.input_rounding(banks.layers[0].format, dtype)  # a bf16 model's int8 inputs: 1e-2 (below)
        assert (inputs is q8_inputs) == (dtype == torch.bfloat16 and isa in Q8_ISAS)
        out = ex.forward(0, hidden, ids, weights)
    finally:
        ex.close()
    assert_close(out, reference(banks, hidden, ids, weights, MX, MX, inputs), atol=1e-2 if inputs else 2e-5)


def test_one_value_pins_the_decode():
    """One q8_0 gate value and an identity-like rest: with hidden = e_k the output is down[:, 0] * silu(gate[k])
    * up[k], gate[k] = d * q only at k = 5. Pins that the executor reads value k of row 0 where gguf_quant says
    (a 34-byte block: fp16 d, then int8 q), whatever the tolerance of the random cases."""
    D = I = 32
    w = torch.zeros(1, 2 * I, D)
    w[0, 0, 5] = 3.0
    w[0, I, :] = 1.0  # up row 0: all ones
    d = torch.zeros(1, D, I)
    d[0, :, 0] = 1.0
    gate_up, down = quantize(w, Q8), quantize(d, Q8)
    gu, dn = dequantize(gate_up, Q8)[0], dequantize(down, Q8)[0]  # 3.0 and 1.0 as the fp16 d makes them
    banks = ExpertBanks([layer(Q8, Q8, {"gate_up": gate_up, "down": down})])
    for isa in ISAS:
        for k in (5, 4):
            hidden = torch.zeros(1, D)
            hidden[0, k] = 1.0
            out = run(banks, hidden, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1), isa, threads=1)
            expect = dn[:, 0] * (torch.nn.functional.silu(gu[0, k]) * gu[I, k])
            assert (expect.abs().min() > 2.0) == (k == 5)
            torch.testing.assert_close(out[0], expect, atol=1e-6, rtol=1e-6)


def test_banks_that_do_not_fit_their_types_are_refused():
    banks, hidden, ids, weights = gguf_case(Q8, Q8, 1, 1, 2, 64, 32)
    L = banks.layers[0].tensors
    ex = CpuExecutor(banks, num_threads=1, spin_us=50, isa=ISAS[-1])
    out = torch.empty(1, 64)
    try:
        short = L["gate_up"][:, :, :-2].contiguous()  # another bank: no types given for it
        with pytest.raises(RuntimeError, match=r"GGUF banks, whose types come from set_gguf_layers"):
            ex._impl.submit(hidden, ids, weights, [short, L["down"]], out, torch.empty(0), 0)
        ex._impl.set_gguf_layers([short], [4], [4])
        with pytest.raises(RuntimeError, match=r"are not \[E, 2I, >= row bytes of D\]"):
            ex._impl.submit(hidden, ids, weights, [short, L["down"]], out, torch.empty(0), 0)
        with pytest.raises(RuntimeError, match=r"types 1..5"):
            ex._impl.set_gguf_layers([short], [0], [4])
    finally:
        ex.close()


def test_loop_counts_gguf_bytes():
    """Loop mode's byte counter (what bench_cpu_executor's GB/s divides) counts each bank's block bytes."""
    banks, hidden, ids, weights = gguf_case(Q4, Q6, 1, 2, 4, 256, 256, seed=3)
    ex = CpuExecutor(banks, num_threads=2, spin_us=50, isa=ISAS[0])
    try:
        ex.start_loop(hidden, torch.tensor([[[0, 1]]]), weights)  # [N=1, T=1, A=2]: two experts per job
        jobs, nbytes, _ = ex.stop_loop()
    finally:
        ex.close()
    per_expert = 2 * 256 * row_bytes(Q4, 256) + 256 * row_bytes(Q6, 256)
    assert banks.expert_nbytes() == per_expert
    assert jobs >= 1 and nbytes == jobs * 2 * per_expert


Q8_CASES = [  # gate_up type, down type, T, A, E, D, I: a bf16 model's layers (int8 inputs)
    (Q4, Q6, 1, 4, 8, 256, 768),  # Q4_K_M's pair, decode; down rows of three blocks
    (Q5, Q4, 5, 3, 6, 512, 512),
    (Q6, Q6, 3, 2, 3, 512, 256),
    (Q4, Q6, 19, 1, 1, 256, 512),  # token passes of 8 and of the rest
    (MX, MX, 3, 2, 2, 2880, 2880),  # gpt-oss's widths: rows of 11.25 input blocks
    (Q8, MX, 5, 3, 4, 288, 544),  # partial last input blocks of one 32-value block (an odd count)
    (Q8, Q6, 2, 2, 3, 2880, 256),  # a 32-value type beside a K-quant
    (MX, Q8, 10, 1, 1, 96, 32),  # rows shorter than one input block; token passes of 8 and 2
]


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("gt, dt, T, A, E, D, I", Q8_CASES, ids=lambda v: getattr(v, "value", str(v)))
def test_bf16_gguf_takes_int8_inputs(gt, dt, T, A, E, D, I, isa):
    """The executor's int8 inputs (hidden and the SwiGLU output, quantized per 256 values, the latter by
    whichever worker completes a block) match the reference that rounds both GEMVs' inputs with q8_inputs; an
    fp32 model's same banks keep the exact fp32-input kernel. The SwiGLU outputs differ from the reference's
    in their last bits, which can move one across a rounding boundary of q8_inputs (up to ~2.5e-3 of the
    output here, per moved input), so the tolerance is 1e-2: what this test guards is the plumbing (which
    inputs, which blocks, when), whose faults move outputs by their whole size; the kernels' exactness is
    pinned below at 2e-6."""
    banks, hidden, ids, weights = gguf_case(gt, dt, T, A, E, D, I, seed=T + D, dtype=torch.bfloat16)
    ex = CpuExecutor(banks, num_threads=3, spin_us=50, isa=isa)
    try:
        assert ex.input_rounding(banks.layers[0].format, torch.bfloat16) is q8_inputs
        out = ex.forward(0, hidden, ids, weights)
    finally:
        ex.close()
    assert_close(out, reference(banks, hidden, ids, weights, gt, dt, inputs=q8_inputs), atol=1e-2)
    exact = run(banks, hidden.float(), ids, weights, isa)
    assert_close(exact, reference(banks, hidden, ids, weights, gt, dt))


KERNEL_SHAPES = {  # values per block -> (K, T, pad) rows of the int8-input kernel alone
    256: ((256, 1, 0), (768, 10, 6), (512, 3, 2)),  # rows of 1..3 blocks
    # one block; gpt-oss's 2880 (90 blocks: 11 input blocks and a partial one of 2); 91 (a partial one of 3)
    32: ((32, 1, 0), (2880, 10, 6), (2912, 3, 2), (288, 9, 1)),
}


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("qtype", list(GGUFType), ids=lambda t: t.value)
def test_int8_input_kernel_matches_reference(qtype, isa):
    """The int8-input kernel alone on rows of several blocks (32-value types: rows that end in a partial input
    block of 256), 1..10 tokens and padded rows: q8_inputs(X) @ W^T."""
    g = torch.Generator().manual_seed(KERNEL_CODE[qtype])
    for K, T, pad in KERNEL_SHAPES[BLOCK[qtype][0]]:
        W = pad_rows(quantize(torch.randn(1, 24, K, generator=g) / K ** 0.5, qtype), pad)[0].contiguous()
        X = torch.randn(T, K, generator=g) * torch.rand(T, K, generator=g) ** 4 * 10  # blocks of unlike ranges
        Y = build_extension().gemv_gguf(isa, W, KERNEL_CODE[qtype], X, True)
        assert_close(Y, q8_inputs(X) @ dequantize(W, qtype, K).T, atol=2e-6)


@pytest.mark.parametrize("isa", Q8_ISAS)
def test_int8_inputs_round_half_to_even_in_lane_order(isa):
    """Identity q4_K and q6_K rows read the int8 inputs back one by one: inputs of x.5 times the block's scale
    round half to even, each value comes back at its own index (q4_K's lanes swap bits 5 and 6 of the index),
    an all-zero block gives zeros."""
    eye4 = torch.zeros(256, 144, dtype=torch.uint8)
    eye4[:, 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # d = 1.0, dmin = 0
    eye4[:, 4:8] = 1  # scales of sub-blocks 0..3 = 1, mins 0
    eye4[:, 12:16] = 1  # scales of sub-blocks 4..7 = 1 (low nibbles), mins 0
    for v in range(256):  # value v of sub-block j = v // 32: byte 32 (j // 2) + v % 32 of qs, nibble j % 2
        eye4[v, 16 + 32 * (v // 64) + v % 32] = 1 << (4 * (v // 32 % 2))
    eye6 = quantize(torch.eye(256), Q6)  # ~identity: each value read back at its index
    assert torch.equal(dequantize(eye4, Q4, 256), torch.eye(256))
    x = torch.arange(256, dtype=torch.float32) % 64 - 31.5  # ties at every value ...
    x[7] = 127.0  # ... with amax 127: inv = 1, d = 1
    X = torch.stack([x, -x, torch.zeros(256)])
    expect = torch.stack([torch.round(x), torch.round(-x), torch.zeros(256)])
    assert torch.equal(q8_inputs(X), expect) and torch.equal(expect[0, :4], torch.tensor([-32.0, -30, -30, -28]))
    ext = build_extension()
    assert torch.equal(ext.gemv_gguf(isa, eye4, KERNEL_CODE[Q4], X, True), expect)
    w6 = dequantize(eye6, Q6, 256)
    torch.testing.assert_close(ext.gemv_gguf(isa, eye6, KERNEL_CODE[Q6], X, True), expect @ w6.T, atol=1e-5, rtol=1e-6)


def identity_32(qtype: GGUFType, K: int) -> torch.Tensor:
    """K rows of q8_0 or mxfp4_gguf blocks that read back value v of the inputs as row v, scale 1 (q8_0: d = 1,
    q = 1; mxfp4_gguf: E8M0 127 and e2m1 code 2, 2**0 * 1.0)."""
    bb = BLOCK[qtype][1]
    rows = torch.zeros(K, K // 32 * bb, dtype=torch.uint8)
    for v in range(K):
        b, i = bb * (v // 32), v % 32
        if qtype is Q8:
            rows[v, b:b + 2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)  # fp16 1.0
            rows[v, b + 2 + i] = 1
        else:  # value i < 16: the low nibble of byte i, else the high one of byte i - 16
            rows[v, b] = 127
            rows[v, b + 1 + i % 16] = 2 << (4 * (i // 16))
    assert torch.equal(dequantize(rows, qtype, K), torch.eye(K))
    return rows


@pytest.mark.parametrize("isa", Q8_ISAS)
@pytest.mark.parametrize("qtype", [Q8, MX], ids=lambda t: t.value)
def test_int8_inputs_of_32_value_blocks_keep_order_and_a_partial_blocks_own_scale(qtype, isa):
    """Identity q8_0 / mxfp4_gguf rows of 288 values read the int8 inputs back one by one: natural lane order,
    ties half to even, and the 32 values past the last whole 256 quantized on their own amax (63.5 here: d =
    0.5, so they come back in halves; the first block's d = 1 would round them to integers)."""
    x = torch.arange(256, dtype=torch.float32) % 64 - 31.5  # ties at every value, amax 127 (d = 1) ...
    x[7] = 127.0
    tail = (torch.arange(32, dtype=torch.float32) - 15.5) / 2  # ... and ties of 2x, amax 63.5 (d = 0.5)
    tail[3] = 63.5
    X = torch.stack([torch.cat([x, tail]), -torch.cat([x, tail]), torch.zeros(288)])
    expect = torch.stack([torch.cat([torch.round(x), torch.round(2 * tail) / 2])] * 2) * torch.tensor([[1.0], [-1.0]])
    expect = torch.cat([expect, torch.zeros(1, 288)])
    assert torch.equal(q8_inputs(X), expect) and torch.equal(expect[0, 256:258], torch.tensor([-8.0, -7.0]))
    Y = build_extension().gemv_gguf(isa, identity_32(qtype, 288), KERNEL_CODE[qtype], X, True)
    assert torch.equal(Y, expect)


def test_every_vector_isa_has_an_int8_input_kernel():
    """The AVX-512 ISAs (the VNNI kernel, or the AVX2 one on AVX-512 CPUs without VNNI) and AVX2 carry an
    int8-input kernel of every GGUF type, so the forced-ISA cases above cover both kernels on this project's CI machine;
    the scalar ISA keeps the fp32-input kernel."""
    assert Q8_ISAS == [isa for isa in ISAS if isa != "scalar"]
    assert "avx2" in Q8_ISAS and "scalar" in ISAS and "scalar" not in Q8_ISAS

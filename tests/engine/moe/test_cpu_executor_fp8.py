"""CPU executor on fp8_block banks against the torch reference (services/engine/moe/fp8.py dequantize +
moe_reference), for every ISA this CPU has (AVX-512's e4m3 widening in registers and the scalar table).

Weights are random e4m3fn bytes over the whole code space (subnormals, both signs, the largest finite
value; only the two NaN codes left out) with random block scales, so every decode path is exercised.
Shapes cross block edges: D and I not multiples of 128 (partial last blocks), gate rows of one block
split across workers, and I not a multiple of 128 (up's scale rows start on their own grid)."""

from __future__ import annotations

import pytest
import torch

from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.cpu_executor import CpuExecutor, build_extension
from services.engine.moe.fp8 import dequantize, dequantize_gate_up
from services.engine.moe.reference import moe_reference

SHAPES = [  # T, A, E, D, I
    (1, 1, 1, 64, 32),  # one partial block each way
    (1, 2, 4, 300, 200),  # 3 x 2 blocks, both last ones partial
    (5, 3, 6, 256, 128),  # whole blocks, a batch with repeated experts
    (3, 2, 3, 130, 260),  # I = 2 blocks + 4: up's grid starts at scale row 3
]
ISAS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar") if build_extension().select_isa(isa)]


def random_fp8(shape, g) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_case(T, A, E, D, I, seed=0):
    g = torch.Generator().manual_seed(seed)
    banks = ExpertBanks.allocate(ExpertFormat.FP8_BLOCK, 1, E, D, I, torch.float32)
    L = banks.layers[0].tensors
    for name in ("gate_up", "down"):
        L[name].copy_(random_fp8(L[name].shape, g))
    for name in ("gate_up_scale", "down_scale"):  # spread over 2^-16..2^-4: small values, as real scales
        L[name].copy_(torch.exp2(torch.empty(L[name].shape).uniform_(-16, -4, generator=g)))
    hidden = torch.randn(T, D, generator=g)  # [T, D]
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A]
    ids[torch.rand(T, A, generator=g) < 0.2] = -1
    ids[0, 0] = 0  # at least one route
    weights = torch.rand(T, A, generator=g)
    return banks, hidden, ids, weights


def reference(banks, hidden, ids, weights):
    L = banks.layers[0].tensors
    gate_up = dequantize_gate_up(L["gate_up"], L["gate_up_scale"])  # [E, 2I, D] fp32
    down = dequantize(L["down"], L["down_scale"])  # [E, D, I]
    return moe_reference(hidden, ids, weights, gate_up, down)


@pytest.fixture(scope="module")
def executors():
    made: dict = {}

    def get(banks, isa):
        if isa not in made:
            made[isa] = CpuExecutor(banks, num_threads=3, spin_us=50, isa=isa)
        made[isa].banks = banks
        return made[isa]
    yield get
    for ex in made.values():
        ex.close()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}A{}E{}D{}I{}".format(*s))
def test_fp8_matches_reference(executors, shape, isa):
    banks, hidden, ids, weights = fp8_case(*shape, seed=sum(shape))
    out = executors(banks, isa).forward(0, hidden, ids, weights)
    ref = reference(banks, hidden, ids, weights)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out / scale, ref / scale, atol=2e-5, rtol=0)


def reference_bf16_inputs(banks, hidden, ids, weights):
    """The executor's math with bf16 inputs to the FP8 GEMVs (a bf16 model): hidden as given (bf16, exact
    in fp32), gate_up in fp32, the SwiGLU output rounded to bf16, down in fp32, fp32 sums."""
    L = banks.layers[0].tensors
    gate_up = dequantize_gate_up(L["gate_up"], L["gate_up_scale"])  # [E, 2I, D] fp32
    down = dequantize(L["down"], L["down_scale"])  # [E, D, I]
    I = down.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = hidden[tok].float() @ gate_up[e].t()  # [N, 2I]
        act = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]).bfloat16().float()  # [N, I]
        out.index_add_(0, tok, (act @ down[e].t()) * weights[tok, slot, None])
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}A{}E{}D{}I{}".format(*s))
def test_fp8_bf16_hidden(executors, shape, isa):
    """bf16 hidden states (a bf16 model): the vdpbf16ps kernel where the CPU has it (avx512bf16 with VBMI),
    else the fp32-input kernel on the widened input. The tolerance allows the SwiGLU output's bf16
    rounding to fall on the other side of a tie where the two fp32 sums differ in their last bit."""
    banks, hidden, ids, weights = fp8_case(*shape, seed=sum(shape) + 1)
    hidden = hidden.bfloat16()
    ex = executors(banks, isa)
    out = ex.forward(0, hidden, ids, weights)
    bf16_path = ex.fp8_bf16_inputs
    assert isa == "avx512bf16" or not bf16_path  # only the avx512bf16 tier has the dpbf16 FP8 kernel
    ref = reference_bf16_inputs(banks, hidden, ids, weights) if bf16_path else reference(banks, hidden.float(), ids, weights)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out / scale, ref / scale, atol=2e-4 if bf16_path else 2e-5, rtol=0)


FINITE_CODES = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)  # 254 codes


def gemv_isas_and_inputs():
    """(isa, input dtype) pairs that have an FP8 GEMV kernel on this CPU."""
    ext = build_extension()
    pairs = []
    for isa in ISAS:
        for dtype in (torch.float32, torch.bfloat16):
            try:
                ext.gemv_fp8(isa, torch.zeros(1, 1, dtype=torch.float8_e4m3fn), torch.ones(1, 1), torch.zeros(1, 1, dtype=dtype))
            except RuntimeError as exc:
                assert "has no FP8 kernel" in str(exc)
                continue
            pairs.append((isa, dtype))
    return pairs


GEMV_CASES = gemv_isas_and_inputs()


@pytest.mark.parametrize("isa,dtype", GEMV_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fp8_gemv_every_code_exact(isa, dtype):
    """Every finite e4m3 code in every column position of a block (254 x 254: partial blocks both ways),
    read through one-hot inputs: Y[t, n] = W[n, t] x scale, bit for bit (power-of-two scales)."""
    n = FINITE_CODES.numel()
    idx = (torch.arange(n)[:, None] + torch.arange(n)[None, :]) % n  # [N, K]: each row and column sees every code
    W = FINITE_CODES[idx].view(torch.float8_e4m3fn)
    g = torch.Generator().manual_seed(3)
    scale = torch.exp2(torch.randint(-12, 4, (2, 2), generator=g).float())
    X = torch.eye(n, dtype=dtype)  # [T = K, K]
    Y = build_extension().gemv_fp8(isa, W, scale, X)  # [T, N]
    torch.testing.assert_close(Y, dequantize(W, scale).t().contiguous(), atol=0, rtol=0)


# the AVX-512 fp32-input kernel's shift-into-fp16 widening reads the NaN codes as +-480 (no quantizer
# writes them; checking for them would cost that kernel an op per 32 weights): docs/fp8.md
NAN_CASES = [c for c in GEMV_CASES if not (c[1] == torch.float32 and c[0] in ("avx512bf16", "avx512"))]


@pytest.mark.parametrize("isa,dtype", NAN_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_fp8_gemv_nan_code(isa, dtype):
    """A NaN code (0x7F, 0xFF) makes its row's dot product NaN, like torch's dequantize."""
    W = torch.full((3, 200), 0x38, dtype=torch.uint8)  # 1.0
    W[1, 150] = 0x7F
    W[2, 7] = 0xFF
    Y = build_extension().gemv_fp8(isa, W.view(torch.float8_e4m3fn), torch.ones(1, 2), torch.ones(2, 200, dtype=dtype))
    assert torch.isnan(Y[:, 1:]).all() and (Y[:, 0] == 200).all()


@pytest.mark.parametrize("isa,dtype", GEMV_CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("T,N,K", [(1, 16, 2048), (3, 130, 300), (6, 5, 64), (2, 3, 33)])
def test_fp8_gemv_random(isa, dtype, T, N, K):
    """Random codes, scales and inputs against dequantize @ X in fp32: the products are exact in both
    kernels, so only the summation order differs."""
    g = torch.Generator().manual_seed(T * N + K)
    W = random_fp8((N, K), g)
    scale = torch.exp2(torch.empty((N + 127) // 128, (K + 127) // 128).uniform_(-10, 0, generator=g))
    X = torch.randn(T, K, generator=g).to(dtype)
    Y = build_extension().gemv_fp8(isa, W, scale, X)
    ref = X.double() @ dequantize(W, scale).double().t()  # [T, N]
    torch.testing.assert_close(Y.double(), ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-5)


def test_fp8_banks_need_their_scales(executors):
    banks, hidden, ids, weights = fp8_case(1, 1, 1, 64, 32)
    ex = executors(banks, ISAS[-1])
    L = banks.layers[0].tensors
    with pytest.raises(RuntimeError, match="come with two scale banks"):
        ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"]], torch.empty(1, 64), torch.empty(0), 0)
    with pytest.raises(RuntimeError, match=r"gate_up_scale must be contiguous fp32 \[E, 2\*ceil"):
        ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"], L["down_scale"], L["down_scale"]],
                        torch.empty(1, 64), torch.empty(0), 0)

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


def test_fp8_bf16_hidden(executors):
    """bf16 activations with fp8 weights: the executor widens the input to fp32 (no dpbf16 path)."""
    banks, hidden, ids, weights = fp8_case(2, 2, 4, 300, 200, seed=7)
    hidden = hidden.bfloat16()
    out = executors(banks, ISAS[0]).forward(0, hidden, ids, weights)
    ref = reference(banks, hidden.float(), ids, weights)
    scale = ref.abs().max().item()
    torch.testing.assert_close(out / scale, ref / scale, atol=2e-5, rtol=0)


def test_fp8_banks_need_their_scales(executors):
    banks, hidden, ids, weights = fp8_case(1, 1, 1, 64, 32)
    ex = executors(banks, ISAS[-1])
    L = banks.layers[0].tensors
    with pytest.raises(RuntimeError, match="come with two scale banks"):
        ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"]], torch.empty(1, 64), torch.empty(0), 0)
    with pytest.raises(RuntimeError, match=r"gate_up_scale must be contiguous fp32 \[E, 2\*ceil"):
        ex._impl.submit(hidden, ids, weights, [L["gate_up"], L["down"], L["down_scale"], L["down_scale"]],
                        torch.empty(1, 64), torch.empty(0), 0)

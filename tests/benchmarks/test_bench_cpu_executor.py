"""bench_cpu_executor's banks and its correctness check: mxfp4 banks tiled from a random pool (fast to
build, scales in gpt-oss's range, experts distinct) pass the check against the torch reference, and an executor
5 % off fails it (the check is not vacuous)."""

import pytest
import torch

from benchmarks.bench_cpu_executor import activation_dtype, check_output, make_banks
from services.engine.moe.cpu_executor import CpuExecutor
from services.profiler.random_banks import MX_SCALES


@pytest.mark.parametrize("dtype", ["mxfp4", "bfloat16", "fp8"])
def test_banks_pass_the_check_and_a_corrupted_bank_fails(dtype):
    banks = make_banks(dtype, 2, 8, 96, 64)
    L = banks.layers[0].tensors
    if dtype == "mxfp4":
        assert MX_SCALES[0] <= int(L["gate_up_scale"].min()) and int(L["down_scale"].max()) <= MX_SCALES[1]
        assert len(torch.unique(L["gate_up"])) == 256  # every byte: every e2m1 code in both nibbles
        assert not torch.equal(L["gate_up"][0], L["gate_up"][1])  # the pool's tiling leaves experts distinct
    ex = CpuExecutor(banks, num_threads=2, spin_us=50)
    try:
        act = activation_dtype(banks)
        assert check_output(ex, banks, 4, act) < 2e-2
        right = ex.forward
        ex.forward = lambda *a: right(*a) * 1.05  # an executor 5 % off
        with pytest.raises(RuntimeError, match="differs from the reference"):
            check_output(ex, banks, 4, act)
    finally:
        ex.close()


def test_gguf_banks_pass_the_check_and_a_corrupted_bank_fails():
    """GGUF banks filled from a quantized pool (random_banks.fill_gguf_: valid blocks, rows padded past a
    narrower type left alone) through the executor's GGUF kernels and bench_cpu_executor's check."""
    from services.engine.moe.banks import ExpertBanks, host_bank
    from services.engine.moe.gguf_quant import GGUFType, row_bytes
    from services.profiler.random_banks import fill_gguf_
    from tests.engine.moe.test_cpu_executor_gguf import layer

    E, D, I = 8, 256, 256
    width = row_bytes(GGUFType.Q6_K, 256)  # slots as wide as q6_K rows; this layer is q4_K+q6_K
    tensors = {"gate_up": host_bank((E, 2 * I, width), torch.uint8), "down": host_bank((E, D, width), torch.uint8)}
    tensors["gate_up"].fill_(0xFF)  # junk in the padding: NaN fp16 scales if it were read
    fill_gguf_(tensors, GGUFType.Q4_K, GGUFType.Q6_K)
    assert bool((tensors["gate_up"][:, :, row_bytes(GGUFType.Q4_K, 256):] == 0xFF).all())
    assert not torch.equal(tensors["gate_up"][0], tensors["gate_up"][1])  # the pool's tiling leaves experts distinct
    banks = ExpertBanks([layer(GGUFType.Q4_K, GGUFType.Q6_K, tensors)])
    ex = CpuExecutor(banks, num_threads=2, spin_us=50)
    try:
        act = activation_dtype(banks)
        assert act == torch.bfloat16 and check_output(ex, banks, 4, act) < 2e-2
        right = ex.forward
        ex.forward = lambda *a: right(*a) * 1.05  # an executor 5 % off
        with pytest.raises(RuntimeError, match="differs from the reference"):
            check_output(ex, banks, 4, act)
    finally:
        ex.close()

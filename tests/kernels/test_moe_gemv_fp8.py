"""kernels/moe_gemv on fp8_block experts against the torch reference (fp8.dequantize + moe_reference), and
the torch paths of resident (grouped, gathered) on the same banks: random e4m3fn codes over the whole
code space, random block scales, shapes with partial blocks (D, I not multiples of 128), skipped routes;
bf16 activations and CUDA-graph replay on the GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.moe_gemv import moe_gemv
from services.engine.moe.banks import ExpertFormat
from services.engine.moe.fp8 import dequantize, dequantize_gate_up, grid
from services.engine.moe.reference import moe_reference
from services.engine.moe.resident import moe_gathered, moe_grouped
from tests.kernels.conftest import kernel_device

CASES = [  # T, A, E, D, I
    (1, 1, 2, 64, 32),  # one partial block each way
    (1, 4, 8, 300, 200),  # 3 x 2 blocks, last ones partial: tiles straddle block edges
    (3, 2, 5, 256, 130),  # up's scale rows start at 2, not at I // 128
    (40, 2, 8, 160, 96),  # prefill-sized
]


def random_fp8(shape, g) -> torch.Tensor:
    codes = torch.randint(0, 256, shape, generator=g, dtype=torch.int32)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    return codes.to(torch.uint8).view(torch.float8_e4m3fn)


def fp8_case(T, A, E, D, I, seed, device, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    ids[torch.rand(T, A, generator=g) < 0.25] = -1
    weights = torch.rand(T, A, generator=g)
    gate_up, down = random_fp8((E, 2 * I, D), g), random_fp8((E, D, I), g)
    gate_up_scale = torch.exp2(torch.empty(E, 2 * grid(I), grid(D)).uniform_(-14, -6, generator=g))
    down_scale = torch.exp2(torch.empty(E, grid(D), grid(I)).uniform_(-14, -6, generator=g))
    return [t.to(device) for t in (hidden.to(dtype), ids, weights, gate_up, down, gate_up_scale, down_scale)]


def reference(hidden, ids, weights, gate_up, down, gate_up_scale, down_scale):
    dense = dequantize_gate_up(gate_up.cpu(), gate_up_scale.cpu()), dequantize(down.cpu(), down_scale.cpu())
    return moe_reference(hidden.cpu().float(), ids.cpu(), weights.cpu(), *dense)


def assert_close(out, ref, atol):
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.cpu().float() / scale, ref / scale, atol=atol, rtol=0)


@pytest.mark.parametrize("T, A, E, D, I", CASES)
def test_fp8_kernel_matches_reference(T, A, E, D, I):
    args = fp8_case(T, A, E, D, I, seed=T + D, device=kernel_device())
    assert_close(moe_gemv(*args), reference(*args), atol=2e-5)


@pytest.mark.parametrize("impl", [moe_grouped, moe_gathered])
def test_fp8_torch_paths_match_reference(impl):
    args = fp8_case(3, 2, 5, 256, 130, seed=3, device="cpu")
    hidden, ids, weights, gate_up, down, gs, ds = args
    assert_close(impl(hidden, ids, weights, gate_up, down, gate_up_scale=gs, down_scale=ds, fmt=ExpertFormat.FP8_BLOCK),
                 reference(*args), atol=2e-5)
    with pytest.raises(ValueError, match="unquantized expert banks come without scale banks"):  # the format decides
        impl(hidden, ids, weights, gate_up, down, gate_up_scale=gs, down_scale=ds)


def test_fp8_scales_of_the_wrong_grid_are_refused():
    hidden, ids, weights, gate_up, down, gs, ds = fp8_case(1, 1, 2, 300, 200, seed=0, device=kernel_device())
    with pytest.raises(ValueError, match=r"fp8 scales .* do not match \[E, 2\*ceil\(I/128\)"):
        moe_gemv(hidden, ids, weights, gate_up, down, gs[:, :2], ds)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T, A, E, D, I", CASES + [(1, 8, 128, 2048, 768), (132, 8, 128, 2048, 768)])
def test_fp8_bf16_on_gpu_matches_reference(T, A, E, D, I):
    args = fp8_case(T, A, E, D, I, seed=1, device="cuda", dtype=torch.bfloat16)
    assert_close(moe_gemv(*args), reference(*args), atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_cuda_graph_replay():
    args = fp8_case(1, 8, 128, 2048, 768, seed=2, device="cuda", dtype=torch.bfloat16)
    moe_gemv(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_gemv(*args)
    new = fp8_case(1, 8, 128, 2048, 768, seed=3, device="cuda", dtype=torch.bfloat16)
    for old, fresh in zip(args[:3], new[:3]):
        old.copy_(fresh)
    graph.replay()
    assert_close(out, reference(*args), atol=1e-2)

"""kernels/gemv against gemv_ref (fp32 matmul, rounded once): one and several rows, odd sizes that leave
partial blocks of rows and of K, a bias, strided rows, every block shape the benchmark sweeps."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench_gemv import BLOCKS
from kernels.gemv import gemv, gemv_ref
from tests.kernels.conftest import kernel_device


def case(T, K, N, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    x = torch.randn(T, K + 5, generator=g).to(dtype).to(dev)[:, :K]  # strided rows
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(dev)
    b = torch.randn(N, generator=g).to(dtype).to(dev) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, K, N, bias", [(1, 64, 32, False), (1, 1000, 37, True), (3, 300, 130, False),
                                           (1, 2048, 128, False)])
def test_matches_reference(T, K, N, bias, dtype):
    x, w, b = case(T, K, N, dtype, bias)
    got = gemv(x, w, b)
    assert got.shape == (T, N) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the fp32 sum
    torch.testing.assert_close(got, gemv_ref(x, w, b), atol=tol, rtol=tol)


@pytest.mark.parametrize("blocks", BLOCKS[::5])
def test_every_block_shape_gives_the_same_result(blocks):
    x, w, b = case(1, 700, 45, torch.float32, True, seed=1)
    torch.testing.assert_close(gemv(x, w, b, blocks=blocks), gemv_ref(x, w, b), atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_shapes():
    x, w, _ = case(1, 64, 32, torch.float32, False)
    with pytest.raises(ValueError, match="gemv"):
        gemv(x, w[:, :60].contiguous())

"""kernels/rmsnorm against its torch reference (transformers' RMSNorm order): with and without the fused
residual add, strided rows, odd sizes, fp32 and bf16 (bf16 must round exactly like torch)."""

from __future__ import annotations

import pytest
import torch

from kernels.rmsnorm import rms_norm, rms_norm_ref
from tests.kernels.conftest import kernel_device


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, N, residual", [(1, 64, False), (1, 64, True), (3, 100, True), (5, 33, False)])
def test_matches_reference(T, N, residual, dtype):
    g = torch.Generator().manual_seed(T * N)
    dev = kernel_device()
    x = torch.randn(T, N + 7, generator=g).to(dtype).to(dev)[:, :N]  # strided rows
    res = torch.randn(T, N, generator=g).to(dtype).to(dev) if residual else None
    w = (1 + 0.1 * torch.randn(N, generator=g)).to(dtype).to(dev)
    out, new_res = rms_norm(x, w, 1e-6, res)
    ref, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert out.dtype == dtype and out.shape == (T, N)
    if residual:
        exact = dtype == torch.float32 or x.is_cuda  # the add rounds as torch's (interpreter: truncates)
        torch.testing.assert_close(new_res, ref_res, atol=0 if exact else 3e-2, rtol=0 if exact else 1e-2)
    else:
        assert new_res is None
    tol = 1e-6 if dtype == torch.float32 else 3e-2  # bf16: the interpreter truncates casts
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
    if dtype == torch.bfloat16 and x.is_cuda:  # GPU rounds like torch: nearly every element identical
        assert (out != ref).float().mean().item() < 0.1


def test_rejects_bad_weight():
    x = torch.randn(2, 8, device=kernel_device())
    with pytest.raises(ValueError, match="rms_norm"):
        rms_norm(x, torch.ones(9, device=x.device), 1e-6)

"""kernels/qk_norm_rope against its torch reference: with and without the per-head norm, a strided qkv
view (as the attention passes it), fp32 and bf16, and the reference against the model's own
apply_rotary/RMSNorm (so the kernel is tied to what the parity tests check)."""

from __future__ import annotations

import pytest
import torch

from kernels.qk_norm_rope import qk_norm_rope_, qk_norm_rope_ref
from services.engine.models.norm import RMSNorm
from services.engine.models.rope import Rotary, apply_rotary
from tests.kernels.conftest import kernel_device


def _case(T, H, K, Dh, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    qkv = torch.randn(T, (H + 2 * K) * Dh, generator=g).to(dtype).to(dev)
    cos, sin = Rotary(Dh, 1e6).cos_sin(torch.arange(3, 3 + T).to(dev), dtype)
    qw = (1 + 0.1 * torch.randn(Dh, generator=g)).to(dtype).to(dev)
    kw = (1 + 0.1 * torch.randn(Dh, generator=g)).to(dtype).to(dev)
    return qkv, cos, sin, qw, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T, H, K, Dh", [(1, 4, 2, 16), (3, 8, 4, 32), (2, 2, 1, 12)])
def test_matches_reference(T, H, K, Dh, norm, dtype):
    qkv, cos, sin, qw, kw = _case(T, H, K, Dh, dtype, seed=T * H + Dh)
    ref_qkv = qkv.clone()
    w = (qw, kw) if norm else (None, None)
    qk_norm_rope_(qkv[:, :(H + K) * Dh].view(T, H + K, Dh), H, cos, sin, *w, eps=1e-6)
    qk_norm_rope_ref(ref_qkv[:, :(H + K) * Dh].view(T, H + K, Dh), H, cos, sin, *w, eps=1e-6)
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: the interpreter truncates casts
    torch.testing.assert_close(qkv, ref_qkv, atol=tol, rtol=tol)
    if dtype == torch.bfloat16 and qkv.is_cuda:  # GPU rounds like torch (the interpreter truncates)
        assert (qkv != ref_qkv).float().mean().item() < 0.1
    torch.testing.assert_close(qkv[:, (H + K) * Dh:], ref_qkv[:, (H + K) * Dh:], atol=0, rtol=0)  # v untouched


def test_reference_equals_model_ops():
    T, H, K, Dh = 3, 4, 2, 16
    qkv, cos, sin, qw, kw = _case(T, H, K, Dh, torch.float32, seed=0)
    qkv, cos, sin, qw, kw = (t.cpu() for t in (qkv, cos, sin, qw, kw))
    qn, kn = RMSNorm(Dh, 1e-6), RMSNorm(Dh, 1e-6)
    qn.weight.data.copy_(qw)
    kn.weight.data.copy_(kw)
    q, k = qkv[:, :H * Dh].view(T, H, Dh), qkv[:, H * Dh:(H + K) * Dh].view(T, K, Dh)
    with torch.no_grad():
        want = torch.cat([apply_rotary(qn(q), cos, sin), apply_rotary(kn(k), cos, sin)], dim=1)
    got = qk_norm_rope_ref(qkv[:, :(H + K) * Dh].view(T, H + K, Dh).clone(), H, cos, sin, qw, kw, 1e-6)
    torch.testing.assert_close(got, want, atol=0, rtol=0)

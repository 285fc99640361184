"""kernels/route_topk against the torch router (services.engine.moe.layer.route with the kernel off):
weights and ids, renormalised or not, E not a power of two, bf16 logits."""

from __future__ import annotations

import pytest
import torch

from kernels.route_topk import route_topk
from services.engine.models import fused
from services.engine.moe.layer import route
from tests.kernels.conftest import kernel_device


def _torch_route(logits, A, renorm):
    old, fused.FORCE = fused.FORCE, False
    try:
        return route(logits, A, renorm)
    finally:
        fused.FORCE = old


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("T, E, A", [(1, 8, 2), (4, 128, 8), (3, 60, 4), (2, 5, 5)])
def test_matches_torch_router(T, E, A, renorm, dtype):
    g = torch.Generator().manual_seed(E * A + T)
    # distinct logits (exact in bf16): a tie would let either implementation pick either expert
    logits = torch.stack([(torch.randperm(E, generator=g) - E // 2) / 8 for _ in range(T)]).to(dtype)
    logits = logits.to(kernel_device())
    w, ids = route_topk(logits, A, renorm)
    ref_w, ref_ids = _torch_route(logits, A, renorm)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (T, A)
    assert torch.equal(ids.cpu(), ref_ids.cpu())
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


def test_model_route_uses_kernel_when_forced():
    logits = torch.randn(2, 16, device=kernel_device())
    old, fused.FORCE = fused.FORCE, True
    try:
        w, ids = route(logits, 4, True)
    finally:
        fused.FORCE = old
    assert "route_topk" not in fused._broken
    ref_w, ref_ids = _torch_route(logits, 4, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)

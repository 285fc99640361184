"""kernels/prefetch_pick against its torch reference: the first B uncached experts of the predicted top-A,
most likely first; -1 when fewer are uncached; bf16 logits; bad arguments named."""

from __future__ import annotations

import pytest
import torch

from kernels.prefetch_pick import prefetch_pick, prefetch_pick_reference
from tests.kernels.conftest import kernel_device


def _case(T, E, L, cached_share, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # distinct logits (exact in bf16): a tie would let either implementation pick either expert
    logits = torch.stack([(torch.randperm(E, generator=g) - E // 2) / 8 for _ in range(T)]).to(dtype)
    slot_of_id = torch.where(torch.rand(L * E, generator=g) < cached_share, torch.arange(L * E), -1).int()
    return logits.to(kernel_device()), slot_of_id.to(kernel_device())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, E, A, B, cached_share", [(1, 128, 8, 2, 0.33), (3, 128, 8, 8, 0.5), (2, 60, 4, 3, 0.0),
                                                      (4, 8, 2, 1, 0.9), (1, 16, 4, 4, 1.0)])
def test_kernel_equals_reference(T, E, A, B, cached_share, dtype):
    L = 3
    logits, slot_of_id = _case(T, E, L, cached_share, seed=T * E + A * B, dtype=dtype)
    for layer in range(L):
        got = prefetch_pick(logits, slot_of_id, layer, A, B)
        want = prefetch_pick_reference(logits, slot_of_id, layer, A, B)
        assert got.dtype == torch.int64 and got.shape == (T, B)
        assert torch.equal(got.cpu(), want.cpu()), (layer, got, want)


def test_reference_picks_the_likeliest_uncached():
    # logits rank experts 5 > 1 > 7 > 0 > ...; 5 and 7 are cached in layer 1 (E = 8)
    logits = torch.tensor([[3.0, 8.0, 0.0, 0.1, 0.2, 9.0, 0.3, 7.0]], device=kernel_device())
    slot_of_id = torch.full((16,), -1, dtype=torch.int32, device=kernel_device())
    slot_of_id[8 + 5], slot_of_id[8 + 7] = 0, 1
    for fn in (prefetch_pick, prefetch_pick_reference):
        assert fn(logits, slot_of_id, 1, 4, 2).tolist() == [[1, 0]]  # top-4: 5, 1, 7, 0 -> uncached 1, 0
        assert fn(logits, slot_of_id, 1, 3, 3).tolist() == [[1, -1, -1]]  # top-3: only 1 uncached
        assert fn(logits, slot_of_id, 0, 3, 2).tolist() == [[5, 1]]  # layer 0: nothing cached


def test_bad_arguments_are_named():
    logits = torch.zeros(1, 8, device=kernel_device())
    table = torch.full((8,), -1, dtype=torch.int32, device=kernel_device())
    for fn in (prefetch_pick, prefetch_pick_reference):
        with pytest.raises(ValueError, match="per_token=3 <= top_k=2"):
            fn(logits, table, 0, 2, 3)

"""kernels/decode_attention against its torch reference (the model's torch decode path: index_put_ into
the cache, gather, SDPA with a mask): several sequences in different slots and positions, GQA, sliding
window, a window W longer than any position, fp32 and bf16; the caches must end up identical."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_attention import decode_attention, decode_attention_ref
from tests.kernels.conftest import kernel_device


def _case(B, H, K, Dh, S, M, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    dev = kernel_device()
    qkv = torch.randn(B, (H + 2 * K) * Dh, generator=g).to(dtype).to(dev)  # strided views, as the model's
    q = qkv[:, :H * Dh].view(B, H, Dh)
    k = qkv[:, H * Dh:(H + K) * Dh].view(B, K, Dh)
    v = qkv[:, (H + K) * Dh:].view(B, K, Dh)
    k_cache = torch.randn(S, M, K, Dh, generator=g).to(dtype).to(dev)
    v_cache = torch.randn(S, M, K, Dh, generator=g).to(dtype).to(dev)
    slots = torch.randperm(S, generator=g)[:B].to(dev)
    positions = torch.randint(0, M - 1, (B,), generator=g).to(dev)
    positions[0] = 0  # a sequence's first token: only its own key
    return q, k, v, k_cache, v_cache, slots, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, K, Dh, window", [(1, 4, 2, 16, 0), (3, 8, 2, 32, 0), (4, 4, 4, 12, 5), (2, 6, 3, 16, 40)])
def test_matches_reference(B, H, K, Dh, window, dtype):
    S, M = 5, 70  # M > BLOCK_N: several key blocks
    q, k, v, kc, vc, slots, positions = _case(B, H, K, Dh, S, M, dtype, seed=B * H + Dh)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    W = M
    got = decode_attention(q, k, v, kc, vc, slots, positions, window, W)
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, positions, window, W)
    assert got.shape == (B, H, Dh) and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_window_shorter_than_cache():
    """W smaller than M: keys at or beyond W are never read (as the torch path's gathered window)."""
    q, k, v, kc, vc, slots, positions = _case(2, 4, 2, 16, 3, 40, torch.float32, seed=7)
    positions[:] = torch.tensor([3, 9])
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = decode_attention(q, k, v, kc, vc, slots, positions, 0, 10)
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, positions, 0, 10)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("chunk_keys", [16, 64])
def test_key_chunks_merge_to_the_reference(window, chunk_keys):
    """Many chunks per head (the split over the keys and their merge), chunks past the position empty,
    a sliding window starting inside a chunk, and a first token (every cached chunk empty)."""
    S, M = 4, 200
    q, k, v, kc, vc, slots, positions = _case(4, 8, 2, 32, S, M, torch.float32, seed=11)
    positions[:] = torch.tensor([0, 15, 130, M - 2])
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = decode_attention(q, k, v, kc, vc, slots, positions, window, M, chunk_keys=chunk_keys)
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, positions, window, M)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)

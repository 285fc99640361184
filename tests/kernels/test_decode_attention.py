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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window, chunk_keys", [(0, None), (0, 16), (37, 16), (128, None)])
def test_sinks_match_reference(window, chunk_keys, dtype):
    """gpt-oss: a sink logit per query head (some far above the scores, so the sink takes most of the
    softmax, some far below), sliding windows, several chunks, a first token."""
    S, M = 4, 200
    B, H, K, Dh = 4, 8, 2, 32
    q, k, v, kc, vc, slots, positions = _case(B, H, K, Dh, S, M, dtype, seed=13)
    positions[:] = torch.tensor([0, 15, 130, M - 2])
    sinks = torch.tensor([0.0, 1.5, -2.0, 8.0, -30.0, 3.0, 0.5, 20.0]).to(dtype).to(q.device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = decode_attention(q, k, v, kc, vc, slots, positions, window, M, chunk_keys=chunk_keys, sinks=sinks)
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, positions, window, M, sinks=sinks)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    without = decode_attention_ref(q, k, v, kc_ref.clone(), vc_ref.clone(), slots, positions, window, M)
    assert not torch.allclose(ref.float(), without.float(), atol=1e-2)  # the sinks change the output


def test_sink_reference_is_the_extra_key_of_the_model():
    """The reference's explicit softmax equals the model's torch path (one extra key, K = V = 0, bias = sink)."""
    B, H, K, Dh, S, M = 2, 4, 2, 16, 3, 40
    q, k, v, kc, vc, slots, positions = _case(B, H, K, Dh, S, M, torch.float32, seed=17)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(0)).to(q.device) * 3
    ref = decode_attention_ref(q, k, v, kc.clone(), vc.clone(), slots, positions, 5, M, sinks=sinks)
    kc[slots, positions], vc[slots, positions] = k, v
    ks = kc[slots].transpose(1, 2)  # [B, K, M, Dh]
    vs = vc[slots].transpose(1, 2)
    key_pos, q_pos = torch.arange(M, device=q.device)[None, :], positions[:, None]
    bias = torch.where((key_pos <= q_pos) & (key_pos > q_pos - 5), 0.0, float("-inf"))[:, None, None, :]
    zero = ks.new_zeros(B, K, 1, Dh)
    bias = torch.cat([bias.expand(B, K, H // K, M), sinks.view(1, K, H // K, 1).expand(B, -1, -1, -1)], dim=-1)
    o = torch.nn.functional.scaled_dot_product_attention(q.reshape(B, K, H // K, Dh), torch.cat([ks, zero], 2),
                                                         torch.cat([vs, zero], 2), attn_mask=bias)
    torch.testing.assert_close(ref, o.reshape(B, H, Dh), atol=1e-5, rtol=1e-5)


def test_sinks_of_the_wrong_shape_are_refused():
    q, k, v, kc, vc, slots, positions = _case(1, 4, 2, 16, 2, 10, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"sinks \(2,\) do not fit \[H\]"):
        decode_attention(q, k, v, kc, vc, slots, positions, 0, 10, sinks=torch.zeros(2, device=q.device))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [0, 128])
def test_sinks_cuda_graph_replay(window):
    """gpt-oss-120b's attention geometry (64 query heads, 8 kv heads, Dh 64), bf16, replayed at new positions."""
    B, H, K, Dh, S, M = 2, 64, 8, 64, 4, 1024
    q, k, v, kc, vc, slots, positions = _case(B, H, K, Dh, S, M, torch.bfloat16, seed=19)
    sinks = torch.randn(H, generator=torch.Generator().manual_seed(1)).to("cuda", torch.bfloat16)
    decode_attention(q, k, v, kc, vc, slots, positions, window, M, sinks=sinks)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, kc, vc, slots, positions, window, M, sinks=sinks)
    positions.copy_(torch.tensor([700, 3], device="cuda"))
    kc_ref, vc_ref = kc.clone(), vc.clone()
    graph.replay()
    ref = decode_attention_ref(q, k, v, kc_ref, vc_ref, slots, positions, window, M, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)

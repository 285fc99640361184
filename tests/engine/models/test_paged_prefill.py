"""Prefill attention through the model's Attention module over a PAGED cache (blocks of each sequence
scattered over the pool in random order, BS = 4) against a naive per-sequence softmax attention written here
over contiguous K/V (GQA by repeating kv heads, explicit causal / sliding-window mask): new prompts, chunks
continuing a cached prefix and decode rows in one step, with and without a window; the new tokens' K/V must
land in exactly their blocks and nothing else in the pool may change. The torch path (the CPU's) and the
Triton kernel (under the interpreter) both."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.engine.models import fused
from services.engine.models.attention import Attention
from services.engine.models.synthetic import synthetic_spec
from services.engine.runtime.kv_cache import ForwardBatch, KVCache

H, K, Dh, S, M, BS = 4, 2, 16, 6, 48, 4


def _attention(window: int | None) -> Attention:
    spec = dataclasses.replace(synthetic_spec("synthetic:tiny", 512), num_heads=H, num_kv_heads=K, head_dim=Dh,
                               sliding_window=window, layer_windows=(), num_layers=1)
    return Attention(spec, 0)


def _reference(q, k, v, batch: ForwardBatch, dense_k, dense_v, window):
    """Per sequence, naively over contiguous [S, M, K, Dh] caches: write K/V, then softmax(q k^T / sqrt(Dh) +
    mask) v over the slot's keys."""
    outs, off = [], 0
    for slot, start, n in zip(batch.slots, batch.start_pos, batch.query_lens):
        end = start + n
        dense_k[slot, start:end], dense_v[slot, start:end] = k[off:off + n], v[off:off + n]
        ks = dense_k[slot, :end].repeat_interleave(H // K, dim=1)  # [end, H, Dh]
        vs = dense_v[slot, :end].repeat_interleave(H // K, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[off:off + n], ks) / Dh ** 0.5  # [H, n, end]
        q_pos, k_pos = torch.arange(start, end)[:, None], torch.arange(end)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= k_pos > q_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        off += n
    return torch.cat(outs)


# (slot, start, new tokens): two fresh prompts, a chunk after a cached prefix, two decode rows
STEP = [(3, 0, 7), (0, 0, 5), (5, 20, 9), (1, 30, 1), (2, 4, 1)]


def _paged(seed: int):
    """STEP's batch, random q/k/v, random contiguous caches and the same contents in a paged KVCache whose
    blocks are a random permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    batch = ForwardBatch(slots=[s for s, _, _ in STEP], start_pos=[p for _, p, _ in STEP],
                         query_lens=[n for _, _, n in STEP])
    q, k, v = (torch.randn(batch.num_tokens, h, Dh, generator=g) for h in (H, K, K))
    dense_k, dense_v = torch.randn(S, M, K, Dh, generator=g), torch.randn(S, M, K, Dh, generator=g)
    MB = M // BS
    spec = dataclasses.replace(synthetic_spec("synthetic:tiny", 512), num_kv_heads=K, head_dim=Dh, num_layers=1)
    kv = KVCache(spec, S, M, "cpu", torch.float32, num_blocks=1 + S * MB, block_size=BS)
    table = (torch.randperm(S * MB, generator=g) + 1).view(S, MB).to(torch.int32)  # block 0 (null) unused
    kv.block_table.copy_(table)
    for s in range(S):
        kv.k[0][table[s].long()] = dense_k[s].view(MB, BS, K, Dh)
        kv.v[0][table[s].long()] = dense_v[s].view(MB, BS, K, Dh)
    return batch, q, k, v, dense_k, dense_v, kv, table


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("triton", [False, True])
def test_prefill_through_the_block_table_matches_naive_attention(window, triton, monkeypatch):
    monkeypatch.setattr(fused, "FORCE", triton)
    monkeypatch.setattr(fused, "_broken", set())
    attn = _attention(window)
    batch, q, k, v, dense_k, dense_v, kv, table = _paged(3)
    got = attn._prefill(q, k, v, batch, kv, kv.k[0], kv.v[0])
    assert not fused._broken
    want = _reference(q, k, v, batch, dense_k, dense_v, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for s in range(S):  # the pool, read back through the table, is the naive cache after its writes
        torch.testing.assert_close(kv.k[0][table[s].long()].reshape(M, K, Dh), dense_k[s], atol=0, rtol=0)
        torch.testing.assert_close(kv.v[0][table[s].long()].reshape(M, K, Dh), dense_v[s], atol=0, rtol=0)


def test_the_packed_step_is_built_once_per_forward():
    batch = ForwardBatch(slots=[2, 0], start_pos=[0, 2], query_lens=[2, 1])
    p = batch.packed(torch.device("cpu"))
    assert p is batch.packed(torch.device("cpu"))
    assert p.tok_slot.tolist() == [2, 2, 0] and p.tok_pos.tolist() == [0, 1, 2]
    assert p.seq_slots.tolist() == [2, 0] and p.seq_start.tolist() == [0, 2] and p.cu_query.tolist() == [0, 2, 3]
    assert p.max_query_len == 2
    for n in (1, 2, 3, 5):  # every column 16-byte aligned whatever N (Triton specializes on alignment)
        q = ForwardBatch(slots=list(range(n)), start_pos=[0] * n, query_lens=[1] * (n - 1) + [2]).packed(torch.device("cpu"))
        assert all(t.data_ptr() % 16 == 0 for t in (q.seq_slots, q.seq_start, q.cu_query))
        assert q.cu_query.tolist() == list(range(n + 1))[:n] + [n + 1] and q.seq_slots.tolist() == list(range(n))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 6])
def test_on_cuda_bf16_matches(window):
    """bf16 on the GPU (the Triton kernel) against the naive reference in fp32."""
    attn = _attention(window).cuda()
    batch, q, k, v, dense_k, dense_v, kv, table = _paged(5)
    want = _reference(q, k, v, batch, dense_k.clone(), dense_v.clone(), window)
    kv.k[0], kv.v[0] = kv.k[0].to("cuda", torch.bfloat16), kv.v[0].to("cuda", torch.bfloat16)
    kv.block_table = kv.block_table.cuda()
    got = attn._prefill(*(t.to("cuda", torch.bfloat16) for t in (q, k, v)), batch, kv, kv.k[0], kv.v[0])
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)

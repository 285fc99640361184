"""Packed prefill attention (all of a step's sequences in one SDPA with a block-diagonal causal bias,
``PackedPrefill``) against a naive per-sequence softmax attention written here (GQA by repeating kv heads,
explicit causal / sliding-window mask): new prompts, chunks continuing a cached prefix and decode rows
in one step, with and without a window; the K/V caches must end up exactly as the writes say. The
per-sequence path (forced by PACK_MAX_ELEMENTS = 0) must give the same, the packed path must be
the one taken (one SDPA call per layer whatever the number of sequences), and cuDNN attention must be
off for every prefill call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from services.engine.models import attention as attention_module
from services.engine.models.attention import Attention
from services.engine.models.synthetic import synthetic_spec
from services.engine.runtime.kv_cache import ForwardBatch

H, K, Dh, S, M = 4, 2, 16, 6, 48


def _attention(window: int | None) -> Attention:
    spec = dataclasses.replace(synthetic_spec("synthetic:tiny", 512), num_heads=H, num_kv_heads=K, head_dim=Dh,
                               sliding_window=window, layer_windows=())
    return Attention(spec, 0)


def _reference(q, k, v, batch: ForwardBatch, k_cache, v_cache, window):
    """Per sequence, naively: write K/V, then softmax(q k^T / sqrt(Dh) + mask) v over the slot's keys."""
    outs, off = [], 0
    for slot, start, n in zip(batch.slots, batch.start_pos, batch.query_lens):
        end = start + n
        k_cache[slot, start:end], v_cache[slot, start:end] = k[off:off + n], v[off:off + n]
        ks = k_cache[slot, :end].repeat_interleave(H // K, dim=1)  # [end, H, Dh]
        vs = v_cache[slot, :end].repeat_interleave(H // K, dim=1)
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


def _step_inputs(seed: int):
    """STEP's batch, random q/k/v for its tokens and random K/V caches (fp32, CPU)."""
    g = torch.Generator().manual_seed(seed)
    batch = ForwardBatch(slots=[s for s, _, _ in STEP], start_pos=[p for _, p, _ in STEP],
                         query_lens=[n for _, _, n in STEP])
    q, k, v = (torch.randn(batch.num_tokens, h, Dh, generator=g) for h in (H, K, K))
    k_cache, v_cache = torch.randn(S, M, K, Dh, generator=g), torch.randn(S, M, K, Dh, generator=g)
    return batch, q, k, v, k_cache, v_cache


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("packed", [True, False])
def test_prefill_matches_naive_attention(window, packed, monkeypatch):
    if not packed:
        monkeypatch.setattr(attention_module, "PACK_MAX_ELEMENTS", 0)
    attn = _attention(window)
    batch, q, k, v, k_cache, v_cache = _step_inputs(3)
    T = batch.num_tokens
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention",
                        lambda *a, **kw: calls.append(torch.backends.cuda.cudnn_sdp_enabled()) or real_sdpa(*a, **kw))
    got = attn._prefill(q, k, v, batch, k_cache, v_cache)
    monkeypatch.undo()
    want = _reference(q, k, v, batch, k_ref, v_ref, window)
    assert got.shape == (T, H, Dh)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert len(calls) == (1 if packed else len(STEP))
    assert not any(calls)  # never cuDNN attention: it builds a plan per new shape (attention.PREFILL_BACKENDS)


def test_packed_bias_is_block_diagonal_causal():
    batch = ForwardBatch(slots=[2, 0], start_pos=[0, 2], query_lens=[2, 1])
    bias = batch.packed(torch.device("cpu")).bias(None, torch.float32)  # [3 tokens, 2 + 3 keys]
    assert torch.equal(batch.packed(torch.device("cpu")).bias(None, torch.float32, 2), bias.repeat_interleave(2, 0))
    inf = float("-inf")
    want = torch.tensor([[0, inf, inf, inf, inf],
                         [0, 0, inf, inf, inf],
                         [inf, inf, 0, 0, 0]])
    assert torch.equal(bias, want)
    assert batch.packed(torch.device("cpu")) is batch.packed(torch.device("cpu"))  # built once per forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 6])
def test_on_cuda_bf16_packed_matches_and_runs_no_cudnn_kernel(window):
    """bf16 on the GPU against the naive reference in fp32, and no cuDNN kernel in the profile (a cuDNN
    plan per new shape is what PREFILL_BACKENDS keeps off the request path)."""
    from torch.profiler import ProfilerActivity, profile

    attn = _attention(window).cuda()
    batch, q, k, v, k_cache, v_cache = _step_inputs(5)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    want = _reference(q, k, v, batch, k_ref, v_ref, window)
    dev = [t.to("cuda", torch.bfloat16) for t in (q, k, v, k_cache, v_cache)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = attn._prefill(*dev[:3], batch, *dev[3:])
        torch.cuda.synchronize()
    names = [e.name.lower() for e in prof.events()]
    assert not [n for n in names if "cudnn" in n], "prefill attention ran a cuDNN kernel"
    torch.testing.assert_close(got.float().cpu(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(dev[3].float().cpu(), k_ref.to(torch.bfloat16).float())

"""decode_attention: one decode token per sequence — write its K/V into the slot cache and attend over
the cache, in two launches (flash-decoding: split the keys, then merge).

Dimension legend: B sequences (one new token each) · H query heads · K kv heads · G = H/K · Dh head dim ·
S cache slots · M max_seq_len · W attended window (keys [0, W), the runner's static kv_len) · C key chunks.

Why: the torch decode path is 5-6 kernels per layer (two index_put_ into the cache, two gathers of the
slot's [W, K, Dh] keys/values, SDPA, a copy of its output) plus a mask. Here program (b, h, c) reads chunk
c of the cache of slot ``slots[b]`` in place, only the keys its token may see (``j < positions[b]``,
within the sliding window), and keeps its partial softmax state; a second launch merges the C states of
each (b, h). Chunk 0 takes the new token's key/value from the projection itself, and its programs of
query heads ``h % G == 0`` store that key/value at ``[slot, position]`` (no other program reads that
entry: no race). Online softmax in fp32 (as flash attention); scale 1/sqrt(Dh) as SDPA.
Why the split: at bs=1 one program per head is B*H = 32 programs for 132 SMs, each walking the whole
context; on the H200 that was 68 us per layer at ~450 tokens, half the resident decode step
(docs/results/history.md run 22). C is fixed by W, not by the position, so a captured graph fits every step.

Attention sinks (gpt-oss): a learned logit per query head joins every softmax and its share is dropped
(transformers' eager_attention_forward: softmax over [scores, sink], the sink's column removed). Only the
merge sees it: M = max(chunk maxima, sink), denominator += e^(sink - M); the chunks are untouched.

The reference is ``decode_attention_ref`` (SDPA over the gathered window; with sinks an explicit softmax
over the scores and the sink column); tests/kernels/test_decode_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MIN_CHUNK_KEYS = 64  # keys per program at least (one BLOCK_N)
MAX_CHUNKS = 64  # programs per (sequence, head) at most: the merge holds them all in registers (past a
# 4096-key window the chunks grow instead, and a short context again runs on few programs)


@triton.jit
def _decode_attention_split_kernel(
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
    G, Dh, W, WINDOW, scale, CHUNK,
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh,
    s_kcs, s_kcm, s_kck, s_vcs, s_vcm, s_vck,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Program (b, h, c): query head h of sequence b over cached keys [lo + c*CHUNK, +CHUNK) -> its partial
    softmax state (max m, sum l, unnormalised acc [Dh]) at m/l [B, H, C], acc [B, H, C, Dh]. Chunk 0 also
    holds the new token's own key/value (always visible), and its programs of heads h % G == 0 store them."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    kvh = h // G
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int32)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < Dh
    q = tl.load(q_ptr + b * s_qb + h * s_qh + offs_d, mask=mask_d, other=0.0).to(tl.float32)  # [BLOCK_D]
    k_new = tl.load(k_ptr + b * s_kb + kvh * s_kh + offs_d, mask=mask_d, other=0.0)
    v_new = tl.load(v_ptr + b * s_vb + kvh * s_vh + offs_d, mask=mask_d, other=0.0)
    if (h % G == 0) & (c == 0):  # one program per kv head writes the new entry
        tl.store(kc_ptr + slot * s_kcs + p * s_kcm + kvh * s_kck + offs_d, k_new, mask=mask_d)
        tl.store(vc_ptr + slot * s_vcs + p * s_vcm + kvh * s_vck + offs_d, v_new, mask=mask_d)
    m_own = tl.sum(q * k_new.to(tl.float32), axis=0) * scale
    first = c == 0
    m = tl.where(first, m_own, float("-inf"))
    l_sum = tl.where(first, 1.0, 0.0)
    acc = tl.where(first, v_new.to(tl.float32), 0.0)  # [BLOCK_D]
    lo = tl.where(WINDOW > 0, tl.maximum(p - WINDOW + 1, 0), 0) + c * CHUNK
    hi = tl.minimum(tl.minimum(p, W), lo + CHUNK)  # this chunk's cached keys [lo, hi), maybe none
    kc = kc_ptr + slot * s_kcs + kvh * s_kck
    vc = vc_ptr + slot * s_vcs + kvh * s_vck
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < hi
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(kc + offs_n[:, None] * s_kcm + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_N]
        s = tl.where(mask_n, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))  # finite: the block holds at least one key
        alpha = tl.exp(m - m_new)
        pr = tl.exp(s - m_new)  # [BLOCK_N], 0 where masked
        v = tl.load(vc + offs_n[:, None] * s_vcm + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
        l_sum = l_sum * alpha + tl.sum(pr, axis=0)
        acc = acc * alpha + tl.sum(pr[:, None] * v, axis=0)
        m = m_new
    C = tl.num_programs(2)
    row = (b * tl.num_programs(1) + h) * C + c
    tl.store(m_ptr + row, m)
    tl.store(l_ptr + row, l_sum)
    tl.store(acc_ptr + row * Dh + offs_d, acc, mask=mask_d)


@triton.jit
def _decode_attention_merge_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, Dh, C, s_ob, s_oh,
                                   BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr, SINK: tl.constexpr):
    """Program (b, h): the C partial states -> o[b, h] = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c,
    with SINK also + e^(sink[h] - M) in the denominator (and M = max(m_c, sink[h]))."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c = offs_c < C
    base = (b * tl.num_programs(1) + h) * C
    m = tl.load(m_ptr + base + offs_c, mask=mask_c, other=float("-inf"))  # chunk 0 is always finite
    m_max = tl.max(m, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.exp(m - m_max)  # [BLOCK_C], 0 for empty chunks
    l_sum = tl.sum(w * tl.load(l_ptr + base + offs_c, mask=mask_c, other=0.0), axis=0)
    if SINK:  # the sink's share of the softmax: in the denominator, no value
        l_sum += tl.exp(sink - m_max)
    acc = tl.load(acc_ptr + (base + offs_c[:, None]) * Dh + offs_d[None, :],
                  mask=mask_c[:, None] & (offs_d[None, :] < Dh), other=0.0)  # [BLOCK_C, BLOCK_D]
    out = tl.sum(w[:, None] * acc, axis=0) / l_sum
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < Dh)


def decode_attention_ref(q, k, v, k_cache, v_cache, slots, positions, window: int, W: int,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch (the model's own torch decode path): q [B, H, Dh] · k/v [B, K, Dh] · k/v_cache
    [S, M, K, Dh] (written at [slots, positions]) · window (0 = none) · W · sinks [H] or None -> o [B, H, Dh]."""
    B, H, Dh = q.shape
    K = k.shape[1]
    k_cache[slots, positions] = k
    v_cache[slots, positions] = v
    ks = k_cache[:, :W][slots].transpose(1, 2)  # [B, K, W, Dh]
    vs = v_cache[:, :W][slots].transpose(1, 2)
    key_pos, q_pos = torch.arange(W, device=q.device)[None, :], positions[:, None]
    allowed = key_pos <= q_pos
    if window:
        allowed &= key_pos > q_pos - window
    qg = q.reshape(B, K, H // K, Dh)
    if sinks is None:
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=allowed[:, None, None, :])
        return o.reshape(B, H, Dh)
    # as transformers' eager_attention_forward: softmax over [scores, sink] in fp32, the sink column dropped
    scores = (qg.float() @ ks.float().transpose(-1, -2)) * Dh ** -0.5  # [B, K, G, W]
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    sink = sinks.float().view(1, K, H // K, 1).expand(B, -1, -1, -1)  # [B, K, G, 1]
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, K, G, W]
    return (probs @ vs.float()).reshape(B, H, Dh).to(q.dtype)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int,
                     W: int, chunk_keys: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Two launches (chunks, merge): q [B, H, Dh] · k/v [B, K, Dh] (the new token's, last dims contiguous) · k/v_cache
    [S, M, K, Dh] · slots/positions [B] int64 on the device · window (0 = full attention) · W (keys
    beyond are never read) -> o [B, H, Dh] contiguous, q's dtype. Writes k/v at [slots, positions].
    Same contract as ``decode_attention_ref``. ``chunk_keys``: keys per program (a power of two; default
    from W, at most MAX_CHUNKS chunks). ``sinks`` [H] (gpt-oss): one logit per query head in every softmax."""
    B, H, Dh = q.shape
    K = k.shape[1]
    if (k.shape != (B, K, Dh) or v.shape != (B, K, Dh) or k_cache.shape[2:] != (K, Dh)
            or v_cache.shape != k_cache.shape or H % K or slots.shape != (B,) or positions.shape != (B,)):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, slots {tuple(slots.shape)}, "
                         f"positions {tuple(positions.shape)} do not fit [B, H, Dh], [B, K, Dh], [S, M, K, Dh], [B]")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)):
        raise ValueError("decode_attention: q, k, v and the caches need a contiguous last dimension")
    if sinks is not None and (sinks.shape != (H,) or sinks.stride(0) != 1):
        raise ValueError(f"decode_attention: sinks {tuple(sinks.shape)} do not fit [H] = ({H},) (contiguous)")
    o = torch.empty((B, H, Dh), dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    chunk = chunk_keys or max(MIN_CHUNK_KEYS, triton.next_power_of_2(triton.cdiv(W, MAX_CHUNKS)))
    C = max(1, triton.cdiv(min(W, window) if window else W, chunk))  # fixed by W: graphs capture the grid
    m = torch.empty((B, H, C), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty((B, H, C, Dh), dtype=torch.float32, device=q.device)
    BLOCK_D = triton.next_power_of_2(Dh)
    _decode_attention_split_kernel[(B, H, C)](
        q, k, v, k_cache, v_cache, slots, positions, m, l_sum, acc,
        H // K, Dh, W, window or 0, Dh ** -0.5, chunk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        BLOCK_N=min(64, chunk), BLOCK_D=BLOCK_D, num_warps=4,
    )
    _decode_attention_merge_kernel[(B, H)](m, l_sum, acc, o, sinks if sinks is not None else m, Dh, C,
                                           o.stride(0), o.stride(1), BLOCK_C=triton.next_power_of_2(C),
                                           BLOCK_D=BLOCK_D, SINK=sinks is not None, num_warps=4)
    return o

"""decode_attention: one decode token per sequence — write its K/V into the paged cache and attend over
the cache in place, in two launches (flash-decoding: split the keys, then merge).

Dimension legend: B sequences (one new token each) · H query heads · K kv heads · G = H/K · Dh head dim ·
NB cache blocks · BS tokens per block · S slots (block-table rows) · MB blocks per row · W static bound on
positions (positions < W) · C split programs per (sequence, kv head) · N keys per tile (BLOCK_N).

Paged addressing: per layer k/v_cache [NB, BS, K, Dh]; token position j of slot s lives at
``cache[block_table[s, j // BS], j % BS]``. A row's entries past its used blocks are arbitrary and never
read: every block-table load is masked to the keys the row may see.

Why: the torch decode path is 5-6 kernels per layer (two index_put_ into the cache, two gathers of the
slot's keys/values, SDPA, a copy of its output) plus a mask. Here program (b, kv head, c) reads the cache
in place, only the keys its token may see (``lo <= j < positions[b]``, lo from the sliding window), and
keeps a partial softmax state per query head; a second launch merges the C states of each (b, h). Split 0
takes the new token's key/value from the projection itself and stores them at their paged place (one
writer per kv head; no program reads that entry, the other splits stop at ``j < p``).
Why fold GQA: the G query heads of a kv head are one [G, Dh] block of a program (padded to 16 rows for
tl.dot), so each K/V tile is read once per kv head, not G times (the per-query-head kernel read each
tile G = 8 times for gpt-oss and Qwen3-30B-A3B).
Why an interleaved split: C is a fixed small number (from static sizes), and split c walks the key tiles
c, c + C, c + 2C, ... of its row's own range [lo, p). A short context is spread over min(C, tiles)
programs and no program walks keys past the position; a long one loops more per program. The previous
kernel chunked the static window W into C contiguous ranges: at W = 131072 a 500-token context ran on
one program per head over a 2048-key chunk, and at 16 streams W = 33000 cost 10.1 ms a step vs 6.5 ms at
W = 4096. Splits with no tile (c >= tiles, c > 0) write nothing; the merge skips them by the same count.
Measured (H200, Qwen3-30B-A3B's 32/4 heads, Dh 128, bf16, one layer): B=16 at 4k keys 42 us (the previous
kernel: 356 us), at 500 keys 12 us (67 us at W = 40960); B=1 at 16k keys 15 us (106 us), ~4 TB/s past 16k
keys at B >= 16.
Graph capture: the grid is (B, K, C) and (B, H), fixed by B, K and C only; positions, the window's start
and the block table are read on the device, so one captured graph fits every step.

Online softmax in fp32 (log2 domain: exp2 with the scale 1/sqrt(Dh) * log2(e) folded into the scores).
Attention sinks (gpt-oss): a learned logit per query head joins every softmax and its share is dropped
(transformers' eager_attention_forward: softmax over [scores, sink], the sink's column removed). Only the
merge sees it: M = max(split maxima, sink), denominator += 2^(sink·log2e - M); the splits are untouched.

The reference is ``decode_attention_ref`` (torch: write through the block table, gather each row's keys,
SDPA; with sinks an explicit softmax over the scores and the sink column); tests/kernels/test_decode_attention.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

# Measured on the H200 (bf16, 16-token blocks, one layer, both launches, CUDA-graph timed): 64-key tiles
# beat 32 past ~4k keys (Qwen3-30B-A3B, B=16, 16k keys: 131 vs 142 us) and cost < 1 us below; ~512 split
# programs per launch was best at every batch (B=16, K=4: C=8 42 us at 4k keys vs 57 us at C=64; B=1:
# C=64 14 us at 16k keys vs 28 us at C=16); 4 warps beat 8 everywhere (B=16, 16k keys: 129 vs 153 us).
BLOCK_N = 64  # keys per tile
TARGET_PROGRAMS = 512  # split programs per launch the default C aims at (~4 per SM of an H200's 132)
MAX_SPLITS = 64  # C at most: the merge holds all C states of a head in registers
NUM_WARPS = 4
LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # the kernels' window for "none": longer than any position


@triton.jit
def _key_tiles(p, WINDOW, BLOCK_N: tl.constexpr):
    """The cached keys a token at position p sees: [lo, p) (lo from the sliding window, NO_WINDOW for none),
    as tiles [t_lo, t_hi) of BLOCK_N keys aligned to absolute positions."""
    lo = tl.maximum(p + 1 - WINDOW, 0)
    return lo, lo // BLOCK_N, (p + BLOCK_N - 1) // BLOCK_N


@triton.jit
def _decode_attention_split_kernel(
    # pointers
    q_ptr, k_ptr, v_ptr, kc_ptr, vc_ptr, bt_ptr, slots_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr,
    # sizes
    G, Dh, WINDOW, qk_scale, C,
    # strides (last dims contiguous)
    s_qb, s_qh, s_kb, s_kh, s_vb, s_vh, s_bt,
    s_kcb, s_kct, s_kck, s_vcb, s_vct, s_vck,
    # meta-parameters
    PAGE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Program (b, kvh, c): the G query heads of kv head kvh of sequence b over key tiles c, c + C, ... of
    [lo, p) -> partial softmax states (max m and sum l in log2 units, unnormalised acc [Dh]) at m/l
    [B, H, C], acc [B, H, C, Dh]. Split 0 also holds the new token (always visible) and writes it to the
    cache. EXACT: K/V in fp32 and ieee dots (fp32 inputs, and the interpreter, whose bf16 dots are wrong)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    c = tl.program_id(2)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    p = tl.load(pos_ptr + b).to(tl.int32)
    bt_row = bt_ptr + slot * s_bt
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < G
    mask_d = offs_d < Dh
    heads = kvh * G + offs_g  # [BLOCK_G]
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_G, BLOCK_D]
    k_new = tl.load(k_ptr + b * s_kb + kvh * s_kh + offs_d, mask=mask_d, other=0.0)  # [BLOCK_D]
    v_new = tl.load(v_ptr + b * s_vb + kvh * s_vh + offs_d, mask=mask_d, other=0.0)
    if EXACT:
        q = q.to(tl.float32)
    first = c == 0
    if first:  # one writer per kv head: the new token at its paged place
        blk_p = tl.load(bt_row + p // PAGE).to(tl.int64)
        tl.store(kc_ptr + blk_p * s_kcb + (p % PAGE) * s_kct + kvh * s_kck + offs_d,
                 k_new.to(kc_ptr.dtype.element_ty), mask=mask_d)
        tl.store(vc_ptr + blk_p * s_vcb + (p % PAGE) * s_vct + kvh * s_vck + offs_d,
                 v_new.to(vc_ptr.dtype.element_ty), mask=mask_d)
    s_own = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale  # [BLOCK_G]
    m = tl.where(first, s_own, float("-inf"))
    l_sum = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.where(first, 1.0, 0.0) * v_new.to(tl.float32)[None, :] + tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    lo, t_lo, t_hi = _key_tiles(p, WINDOW, BLOCK_N)
    kc = kc_ptr + kvh * s_kck
    vc = vc_ptr + kvh * s_vck
    for t in range(t_lo + c, t_hi, C):
        offs_n = t * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = (offs_n >= lo) & (offs_n < p)
        blk = tl.load(bt_row + offs_n // PAGE, mask=mask_n, other=0).to(tl.int64)  # [BLOCK_N]
        row_k = blk * s_kcb + (offs_n % PAGE) * s_kct
        row_v = blk * s_vcb + (offs_n % PAGE) * s_vct
        mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(kc + row_k[:, None] + offs_d[None, :], mask=mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(vc + row_v[:, None] + offs_d[None, :], mask=mask, other=0.0)
        if EXACT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # finite: every tile holds a visible key
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(s - m_new[:, None])  # 0 where masked
        l_sum = l_sum * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision="ieee")
        m = m_new
    live = mask_g & (tl.full([BLOCK_G], c, tl.int32) < tl.maximum(t_hi - t_lo, 1))  # a split with no tile writes nothing
    rows = (b * tl.num_programs(1) * G + heads) * C + c  # [BLOCK_G]
    tl.store(m_ptr + rows, m, mask=live)
    tl.store(l_ptr + rows, l_sum, mask=live)
    tl.store(acc_ptr + rows[:, None] * Dh + offs_d[None, :], acc, mask=live[:, None] & mask_d[None, :])


@triton.jit
def _decode_attention_merge_kernel(m_ptr, l_ptr, acc_ptr, o_ptr, sink_ptr, pos_ptr, Dh, WINDOW, C, s_ob, s_oh,
                                   BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                                   SINK: tl.constexpr):
    """Program (b, h): the live splits' states -> o[b, h] = sum_c 2^(m_c - M) acc_c / sum_c 2^(m_c - M) l_c,
    with SINK also + 2^(sink[h]·log2e - M) in the denominator (and M = max(m_c, sink[h]·log2e))."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.load(pos_ptr + b).to(tl.int32)
    _, t_lo, t_hi = _key_tiles(p, WINDOW, BLOCK_N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_d = tl.arange(0, BLOCK_D)
    mask_c = offs_c < tl.minimum(C, tl.maximum(t_hi - t_lo, 1))  # the splits with a tile; split 0 always
    base = (b * tl.num_programs(1) + h) * C
    m = tl.load(m_ptr + base + offs_c, mask=mask_c, other=float("-inf"))
    m_max = tl.max(m, axis=0)
    if SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634  # log2 units, as m
        m_max = tl.maximum(m_max, sink)
    w = tl.where(mask_c, tl.exp2(m - m_max), 0.0)  # [BLOCK_C]
    l_sum = tl.sum(w * tl.load(l_ptr + base + offs_c, mask=mask_c, other=0.0), axis=0)
    if SINK:  # the sink's share of the softmax: in the denominator, no value
        l_sum += tl.exp2(sink - m_max)
    acc = tl.load(acc_ptr + (base + offs_c[:, None]) * Dh + offs_d[None, :],
                  mask=mask_c[:, None] & (offs_d[None, :] < Dh), other=0.0)  # [BLOCK_C, BLOCK_D]
    out = tl.sum(w[:, None] * acc, axis=0) / l_sum
    tl.store(o_ptr + b * s_ob + h * s_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=offs_d < Dh)


def default_splits(B: int, K: int, W: int, window: int) -> int:
    """C from static sizes only (graph capture): ~TARGET_PROGRAMS programs over the B·K (sequence, kv head)
    pairs, at most MAX_SPLITS, and no more than the tiles of the longest key range (W or the window)."""
    keys = min(W, window) if window else W
    tiles = triton.cdiv(keys, BLOCK_N) + (1 if window else 0)  # a window unaligned to the tiles spans one more
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(triton.cdiv(TARGET_PROGRAMS, B * K)), tiles))


def decode_attention_ref(q, k, v, k_cache, v_cache, block_table, slots, positions, window: int, W: int,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: q [B, H, Dh] · k/v [B, K, Dh] · k/v_cache [NB, BS, K, Dh] (written through the block
    table at [block_table[slots, positions // BS], positions % BS]) · block_table [S, MB] · slots/positions
    [B] · window (0 = none) · W (unused: positions < W) · sinks [H] or None -> o [B, H, Dh]. Row by row, each
    over exactly the keys it sees (host reads of the positions: eager use, never in a graph), so a row's
    arithmetic does not depend on the other rows of the step (--batch-invariant on the CPU)."""
    B, H, Dh = q.shape
    K, BS = k.shape[1], k_cache.shape[1]
    rows = block_table[slots].long()  # [B, MB]
    blk_new = rows.gather(1, (positions // BS)[:, None])[:, 0]  # [B]
    k_cache[blk_new, positions % BS] = k
    v_cache[blk_new, positions % BS] = v
    outs = []
    for b, p in enumerate(positions.tolist()):
        key_pos = torch.arange(max(0, p - window + 1) if window else 0, p + 1, device=q.device)  # [L]
        blk = rows[b, key_pos // BS]
        ks = k_cache[blk, key_pos % BS].transpose(0, 1)  # [K, L, Dh]
        vs = v_cache[blk, key_pos % BS].transpose(0, 1)
        qg = q[b].reshape(K, H // K, Dh)  # query head h = kv head (h // G), as transformers' repeat_kv
        if sinks is None:
            outs.append(F.scaled_dot_product_attention(qg, ks, vs).reshape(H, Dh))
            continue
        # as transformers' eager_attention_forward: softmax over [scores, sink] in fp32, the sink column dropped
        scores = (qg.float() @ ks.float().transpose(-1, -2)) / math.sqrt(Dh)  # [K, G, L]
        probs = torch.softmax(torch.cat([scores, sinks.float().view(K, H // K, 1)], dim=-1), dim=-1)[..., :-1]
        outs.append((probs @ vs.float()).reshape(H, Dh).to(q.dtype))
    return torch.stack(outs) if outs else q.new_empty((0, H, Dh))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, block_table: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                     window: int, W: int, sinks: torch.Tensor | None = None, splits: int | None = None) -> torch.Tensor:
    """Two launches (splits, merge): q [B, H, Dh] · k/v [B, K, Dh] (the new token's) · k/v_cache
    [NB, BS, K, Dh] · block_table [S, MB] int32 · slots/positions [B] int64 on the device · window (0 = full
    attention) · W (static bound: positions < W; sizes C, never walked) · sinks [H] (gpt-oss: one logit per
    query head in every softmax) · splits (C; default ``default_splits``) -> o [B, H, Dh] contiguous, q's
    dtype. Writes k/v at [block_table[slots, positions // BS], positions % BS]. Same contract as
    ``decode_attention_ref``. Last dims contiguous."""
    B, H, Dh = q.shape
    K = k.shape[1]
    BS = k_cache.shape[1]
    if (k.shape != (B, K, Dh) or v.shape != (B, K, Dh) or k_cache.shape[2:] != (K, Dh)
            or v_cache.shape != k_cache.shape or H % K or block_table.dim() != 2
            or slots.shape != (B,) or positions.shape != (B,)):
        raise ValueError(f"decode_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, block_table {tuple(block_table.shape)}, "
                         f"slots {tuple(slots.shape)}, positions {tuple(positions.shape)} do not fit [B, H, Dh], "
                         "[B, K, Dh], [NB, BS, K, Dh], [S, MB], [B]")
    if block_table.dtype != torch.int32 or block_table.shape[1] * BS < W:
        raise ValueError(f"decode_attention: block_table {tuple(block_table.shape)} {block_table.dtype} must be "
                         f"int32 and address W = {W} positions ({block_table.shape[1]} blocks x {BS} < {W})")
    if any(t.stride(-1) != 1 for t in (q, k, v, k_cache, v_cache)) or block_table.stride(1) != 1:
        raise ValueError("decode_attention: q, k, v, the caches and block_table need a contiguous last dimension")
    if sinks is not None and (sinks.shape != (H,) or sinks.stride(0) != 1):
        raise ValueError(f"decode_attention: sinks {tuple(sinks.shape)} do not fit [H] = ({H},) (contiguous)")
    if Dh < 16:
        raise ValueError(f"decode_attention: Dh = {Dh} < 16 (tl.dot's smallest inner size)")
    o = torch.empty((B, H, Dh), dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    C = splits or default_splits(B, K, W, window)
    if not 1 <= C <= MAX_SPLITS:
        raise ValueError(f"decode_attention: splits = {C} outside [1, {MAX_SPLITS}]")
    G = H // K
    m = torch.empty((B, H, C), dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty((B, H, C, Dh), dtype=torch.float32, device=q.device)
    BLOCK_D = triton.next_power_of_2(Dh)
    _decode_attention_split_kernel[(B, K, C)](
        q, k, v, k_cache, v_cache, block_table, slots, positions, m, l_sum, acc,
        G, Dh, window or NO_WINDOW, LOG2E / math.sqrt(Dh), C,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=BS, BLOCK_G=max(16, triton.next_power_of_2(G)), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        EXACT=q.dtype == torch.float32 or not q.is_cuda, num_warps=NUM_WARPS,
    )
    _decode_attention_merge_kernel[(B, H)](
        m, l_sum, acc, o, sinks if sinks is not None else m, positions, Dh, window or NO_WINDOW, C, o.stride(0), o.stride(1),
        BLOCK_N=BLOCK_N, BLOCK_C=MAX_SPLITS, BLOCK_D=BLOCK_D, SINK=sinks is not None, num_warps=4,
    )
    return o

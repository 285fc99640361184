"""paged_prefill_attention: causal attention of a prefill / mixed step's new tokens over the PAGED KV cache,
in O(T) memory (flash attention: online softmax over key tiles gathered through the block table).

Dimension legend: T new tokens of the step (packed, a sequence's contiguous) · N sequences · H query heads ·
K kv heads · G = H/K · Dh head dim · NB cache blocks · BS tokens per block · S request slots · MB blocks per
slot · L keys a sequence (or a query chunk) attends · W sliding window (0 = none).

Why: the old path built a [G T, Tk] block-diagonal causal bias (or an [H, rows, L] one with sinks) and SDPA,
which takes no arbitrary bias into its flash kernel, fell back to its math kernel: 35 GiB at a 17k-token
prompt. Here nothing grows with T x L: the kernel holds one [BLOCK_M, BLOCK_N] score tile per program, and
the torch reference (also the engine's CPU path) attends in query chunks of at most MAX_SCORE_ELEMENTS scores.

Layout: per layer ``k_cache`` / ``v_cache`` [NB, BS, K, Dh] (last dim contiguous); ``block_table`` [S, MB]
int32; token position p of slot s lives at ``k_cache[block_table[s, p // BS], p % BS]``. Table entries past
a slot's used blocks are never read. Sequence i (slot ``seq_slots[i]``) has ``seq_start[i]`` tokens cached
before this step and ``query_lens[i] = cu_query[i + 1] - cu_query[i]`` new ones, the rows
``q[cu_query[i]:cu_query[i + 1]]`` at positions ``seq_start[i] + 0, 1, ...``; their K/V are already in the
cache (``write_kv``) when attention runs.

Masking (transformers' convention): the new token at position p sees keys j of its slot with j <= p, and
with a sliding window W > 0 also j > p - W. Scale 1/sqrt(Dh) as SDPA; GQA: query head h reads kv head h // G.

Attention sinks (gpt-oss): a learned logit per query head joins every softmax and its share is dropped
(transformers' eager_attention_forward: softmax over [scores, sink], the sink column removed). The kernel
adds it once, after the key loop: M = max(m, sink), denominator += e^(sink - M).

Kernel: program (kv head, sequence, query tile) holds BLOCK_Q = BLOCK_M // G tokens x the G query heads of
its kv head as BLOCK_M rows (row r: token r // G, head r % G), so each K/V tile is read once for the G heads.
It walks only the keys its tokens can see, [max(0, first_pos - W + 1), last_pos] in BLOCK_N tiles: the
window's edge tile(s) and the diagonal tile(s) masked, the tiles between not (a chunk of a 32k prompt walks
its own prefix, not 32k keys). Query tiles go heaviest (last) first, for the tail of the grid.

The reference is ``paged_prefill_attention_ref``; tests/kernels/test_paged_prefill_attention.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_SCORE_ELEMENTS = 1 << 25  # the reference's largest score / mask tensor per query chunk (128 MiB in fp32)
LOG2E = 1.4426950408889634  # the kernel's softmax runs in base 2 (exp2), scores and sinks scaled by log2(e)
# (BLOCK_M, BLOCK_N, num_warps, num_stages) by (bytes per cache element, padded Dh). H200, bf16, us for a
# 4096-token chunk after a 2048-token prefix: Dh 128 (H 32, K 4): (128, 128, 8, 3) 764, (128, 64, 8, 3) 841,
# (64, 64, 4, 3) 908, and a 16k prompt 5.9 ms (374 TFLOP/s; SDPA's flash kernel over contiguous K/V: 6.7 ms);
# Dh 64 (H 64, K 8, sinks): (128, 64, 8, 3) 821, (128, 128, 8, 3) 1087. fp32 (tests) and Dh 256: tiles that
# fit the 227 KiB of shared memory (fp32 at (128, 128, 8, 3) asked for 257 KiB), not tuned.
TILES = {
    (2, 64): (128, 64, 8, 3), (2, 128): (128, 128, 8, 3), (2, 256): (64, 64, 8, 2),
    (4, 64): (64, 64, 4, 2), (4, 128): (64, 32, 4, 2), (4, 256): (32, 16, 4, 2),
}


@triton.jit
def _load_tile(ptrs, rows_ok, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """[rows, BLOCK_D] from ptrs: rows where rows_ok (MASKED) and the first HEAD_DIM columns, 0 elsewhere."""
    if MASKED:
        if HEAD_DIM == BLOCK_D:
            return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)


@triton.jit
def _attend_keys(
    acc, l_i, m_i, q, q_pos, win_lo,  # running state [BLOCK_M, BLOCK_D], [BLOCK_M] x2; q tile; row positions
    kc, vc, bt_row, n_lo, n_hi, hi,  # cache bases at this kv head; the slot's table row; keys [n_lo, n_hi)
    s_kb, s_ks, s_vb, s_vs, qk_scale,
    BS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr, IEEE: tl.constexpr,
):
    """The online softmax over key tiles [n0, n0 + BLOCK_N) for n0 in [n_lo, n_hi). MASKED: keys at or past
    ``hi`` are not loaded, and row r sees key j only if win_lo[r] < j <= q_pos[r]; else every key is seen."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] key positions
        # physical row of each key: any BS (it need not divide BLOCK_N); int64, the pool can pass 2^31 elements
        if MASKED:
            blk = tl.load(bt_row + pos // BS, mask=pos < hi, other=0).to(tl.int64)
        else:
            blk = tl.load(bt_row + pos // BS).to(tl.int64)
        off = pos % BS
        k = _load_tile(kc + blk[:, None] * s_kb + off[:, None] * s_ks + offs_d[None, :], pos < hi, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        if MASKED:
            seen = (pos[None, :] <= q_pos[:, None]) & (pos[None, :] > win_lo[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        if MASKED:  # a row may see no key of this tile (and none before): keep it at 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_use = m_new
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_tile(vc + blk[:, None] * s_vb + off[:, None] * s_vs + offs_d[None, :], pos < hi, offs_d,
                       HEAD_DIM, BLOCK_D, MASKED)  # [BLOCK_N, BLOCK_D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_prefill_kernel(
    # pointers
    q_ptr, kc_ptr, vc_ptr, bt_ptr, slots_ptr, start_ptr, cu_ptr, sink_ptr, o_ptr,
    # sizes and scalars
    WINDOW, qk_scale,
    # strides (elements; the last dims are contiguous)
    s_qt, s_qh, s_kb, s_ks, s_kk, s_vb, s_vs, s_vk, s_bt, s_ot, s_oh,
    # meta-parameters
    G: tl.constexpr, BS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (kv head, sequence, query tile, last tile first): o of the tile's BLOCK_Q tokens x G heads."""
    BLOCK_Q: tl.constexpr = BLOCK_M // G
    kvh = tl.program_id(0)
    seq = tl.program_id(1)
    tile = tl.num_programs(2) - 1 - tl.program_id(2)
    q_begin = tl.load(cu_ptr + seq)
    q_len = tl.load(cu_ptr + seq + 1) - q_begin
    t0 = tile * BLOCK_Q
    if t0 >= q_len:  # a shorter sequence than the longest: no tokens in this tile
        return
    start = tl.load(start_ptr + seq)
    slot = tl.load(slots_ptr + seq).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tok = t0 + offs_m // G  # [BLOCK_M] token of each row (within the sequence)
    head = kvh * G + offs_m % G  # [BLOCK_M] query head of each row
    rows_ok = (offs_m < BLOCK_Q * G) & (tok < q_len)
    q_row = (q_begin + tok).to(tl.int64)
    q = _load_tile(q_ptr + q_row[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :], rows_ok, offs_d,
                   HEAD_DIM, BLOCK_D, True).to(kc_ptr.dtype.element_ty)  # [BLOCK_M, BLOCK_D]
    q_pos = start + tok  # [BLOCK_M]
    win_lo = tl.where(WINDOW > 0, q_pos - WINDOW, -1)  # row r sees keys (win_lo[r], q_pos[r]]

    # The tile's keys: [lo, hi). Tiles in [n_a, n_b) are seen whole by every row (past the window's edge
    # for the last token, at or below the first token's position); the ones before and after are masked.
    first = start + t0
    last = start + tl.minimum(q_len, t0 + BLOCK_Q) - 1
    hi = last + 1
    lo = tl.where(WINDOW > 0, tl.maximum(first - WINDOW + 1, 0), 0)
    full_lo = tl.where(WINDOW > 0, tl.maximum(last - WINDOW + 1, 0), 0)
    n_start = (lo // BLOCK_N) * BLOCK_N
    diag = ((first + 1) // BLOCK_N) * BLOCK_N
    n_a = tl.maximum(n_start, tl.minimum(tl.cdiv(full_lo, BLOCK_N) * BLOCK_N, diag))
    n_b = tl.maximum(n_a, diag)

    kc = kc_ptr + kvh * s_kk
    vc = vc_ptr + kvh * s_vk
    bt_row = bt_ptr + slot * s_bt
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, win_lo, kc, vc, bt_row, n_start, n_a, hi,
                                 s_kb, s_ks, s_vb, s_vs, qk_scale, BS, HEAD_DIM, BLOCK_N, BLOCK_D, True, IEEE)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, win_lo, kc, vc, bt_row, n_a, n_b, hi,
                                 s_kb, s_ks, s_vb, s_vs, qk_scale, BS, HEAD_DIM, BLOCK_N, BLOCK_D, False, IEEE)
    acc, l_i, m_i = _attend_keys(acc, l_i, m_i, q, q_pos, win_lo, kc, vc, bt_row, n_b, hi, hi,
                                 s_kb, s_ks, s_vb, s_vs, qk_scale, BS, HEAD_DIM, BLOCK_N, BLOCK_D, True, IEEE)

    if HAS_SINKS:  # the sink's share of the softmax: in the denominator, no value
        sink = tl.load(sink_ptr + head, mask=rows_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        m_fin = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_fin)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + tl.exp2(sink - m_fin)
    l_i = tl.where(rows_ok, l_i, 1.0)  # rows of no token: never stored, kept finite
    out = acc / l_i[:, None]
    o_ptrs = o_ptr + q_row[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=rows_ok[:, None] & (offs_d[None, :] < HEAD_DIM))


def _check(name, q, k_cache, v_cache, block_table, seq_slots, seq_start, cu_query, max_query_len, window, sinks):
    """Raise ValueError unless the arguments fit the layout of the module docstring (shapes only: no host sync)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"{name}: q {tuple(q.shape)} must be [T, H, Dh] and k_cache {tuple(k_cache.shape)} "
                         f"[NB, BS, K, Dh]")
    T, H, Dh = q.shape
    K = k_cache.shape[2]
    N = seq_slots.shape[0] if seq_slots.dim() == 1 else -1
    if (k_cache.shape[3] != Dh or v_cache.shape != k_cache.shape or H % K or block_table.dim() != 2
            or seq_slots.shape != (N,) or seq_start.shape != (N,) or cu_query.shape != (N + 1,)):
        raise ValueError(f"{name}: q {tuple(q.shape)}, caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)}, "
                         f"block_table {tuple(block_table.shape)}, seq_slots {tuple(seq_slots.shape)}, seq_start "
                         f"{tuple(seq_start.shape)}, cu_query {tuple(cu_query.shape)} do not fit [T, H, Dh], "
                         f"[NB, BS, K, Dh] with K dividing H, [S, MB], [N], [N], [N + 1]")
    if any(t.dtype.is_floating_point or t.dtype.is_complex for t in (block_table, seq_slots, seq_start, cu_query)):
        raise ValueError(f"{name}: block_table, seq_slots, seq_start and cu_query must be integer tensors")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{name}: k_cache {k_cache.dtype} and v_cache {v_cache.dtype} differ in dtype")
    if max_query_len < 0 or window < 0:
        raise ValueError(f"{name}: max_query_len {max_query_len} and window {window} must be >= 0")
    if sinks is not None and sinks.shape != (H,):
        raise ValueError(f"{name}: sinks {tuple(sinks.shape)} do not fit [H] = ({H},)")


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_table: torch.Tensor, seq_slots: torch.Tensor, seq_start: torch.Tensor,
                            cu_query: torch.Tensor, max_query_len: int, window: int = 0,
                            sinks: torch.Tensor | None = None, *, block_m: int | None = None,
                            block_n: int | None = None) -> torch.Tensor:
    """One launch: q [T, H, Dh] · k/v_cache [NB, BS, K, Dh] (this step's K/V already written) · block_table
    [S, MB] · seq_slots / seq_start [N] · cu_query [N + 1] (integer tensors on q's device, cu_query[N] = T) ·
    max_query_len >= max(cu_query diff), a host int (it sizes the grid: no host sync) · window (0 = none) ·
    sinks [H] or None -> o [T, H, Dh] contiguous, q's dtype. The dots run in the caches' dtype (q is cast
    to it), accumulation in fp32; fp32 caches use IEEE fp32 dots (no tf32). ``block_m`` (rows = tokens x G,
    a power of two >= 16) and ``block_n`` (keys per tile, a power of two >= 16) override the defaults."""
    _check("paged_prefill_attention", q, k_cache, v_cache, block_table, seq_slots, seq_start, cu_query,
           max_query_len, window, sinks)
    if any(t.stride(-1) != 1 for t in (q, k_cache, v_cache)) or (block_table.numel() and block_table.stride(1) != 1):
        raise ValueError("paged_prefill_attention: q, the caches and block_table need a contiguous last dimension")
    if sinks is not None and sinks.stride(0) != 1:
        raise ValueError("paged_prefill_attention: sinks must be contiguous")
    T, H, Dh = q.shape
    BS, K = k_cache.shape[1], k_cache.shape[2]
    G, N = H // K, seq_slots.shape[0]
    if Dh > 256 or k_cache.element_size() not in (2, 4):
        raise ValueError(f"paged_prefill_attention: Dh {Dh} (at most 256) or cache dtype {k_cache.dtype} (bf16, fp16, "
                         f"fp32) not supported")
    o = torch.empty((T, H, Dh), dtype=q.dtype, device=q.device)
    if T == 0 or N == 0 or max_query_len == 0:
        return o
    BLOCK_D = max(16, triton.next_power_of_2(Dh))
    tile_m, tile_n, warps, stages = TILES[(k_cache.element_size(), max(64, BLOCK_D))]
    BLOCK_M = max(block_m or tile_m, triton.next_power_of_2(G))  # rows = tokens x G: whole tokens a tile
    BLOCK_N = block_n or tile_n
    if BLOCK_M & (BLOCK_M - 1) or BLOCK_N & (BLOCK_N - 1) or min(BLOCK_M, BLOCK_N) < 16:  # tl.dot: >= 16
        raise ValueError(f"paged_prefill_attention: block_m {BLOCK_M} and block_n {BLOCK_N} must be powers of two "
                         f">= 16")
    block_q = BLOCK_M // G
    grid = (K, N, triton.cdiv(max_query_len, block_q))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, block_table, seq_slots, seq_start, cu_query, sinks if sinks is not None else q, o,
        window, Dh ** -0.5 * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_table.stride(0), o.stride(0), o.stride(1),
        G=G, BS=BS, HEAD_DIM=Dh, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, HAS_SINKS=sinks is not None,
        IEEE=k_cache.dtype == torch.float32, num_warps=warps, num_stages=stages,
    )
    return o


def _chunk_rows(left: int, first: int, window: int, H: int) -> int:
    """Query rows of the next chunk (``left`` rows to go, the first at position ``first``) so that
    H x rows x keys <= MAX_SCORE_ELEMENTS: r rows see at most r + c keys, c = first (and <= W - 1 with a
    window), so r is the largest with r (r + c) <= MAX_SCORE_ELEMENTS / H (at least 1)."""
    budget = MAX_SCORE_ELEMENTS // H
    c = min(first, window - 1) if window else first
    r = int((math.sqrt(c * c + 4 * budget) - c) / 2)
    while r * (r + c) > budget:  # the float root may round up
        r -= 1
    return max(1, min(left, r))


def _gather(cache: torch.Tensor, table_row: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """cache [NB, BS, K, Dh] -> the slot's keys (or values) at positions [lo, hi) as [K, L, Dh] (a copy)."""
    BS = cache.shape[1]
    pos = torch.arange(lo, hi, device=cache.device)
    return cache[table_row[pos // BS].long(), pos % BS].transpose(0, 1).contiguous()  # [K, L, Dh]


def _attend_chunk(qc: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, first: int, lo: int, window: int,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """qc [r, H, Dh] (positions [first, first + r)) over ks/vs [K, L, Dh] (positions [lo, lo + L)) -> [r, H, Dh]."""
    r, H, Dh = qc.shape
    K, L = ks.shape[:2]
    G = H // K
    if sinks is None and first == 0 and (not window or r <= window):
        # a whole prompt from 0 in one chunk: exactly SDPA on the full problem (CPU tests compare greedy
        # tokens with transformers); K/V repeated for GQA here, at most H x sqrt(MAX_SCORE_ELEMENTS / H) x Dh
        o = F.scaled_dot_product_attention(qc.transpose(0, 1)[None], ks[None], vs[None], is_causal=True,
                                           enable_gqa=True)  # [1, H, r, Dh]
        return o[0].transpose(0, 1)
    key_pos = torch.arange(lo, lo + L, device=qc.device)[None, :]
    q_pos = torch.arange(first, first + r, device=qc.device)[:, None]
    seen = key_pos <= q_pos  # [r, L]
    if window:
        seen &= key_pos > q_pos - window
    if sinks is None:  # the CPU's flash kernel takes GQA without repeating K/V (torch 2.13)
        o = F.scaled_dot_product_attention(qc.transpose(0, 1)[None], ks[None], vs[None], attn_mask=seen,
                                           enable_gqa=True)  # [1, H, r, Dh]
        return o[0].transpose(0, 1)
    # as transformers' eager_attention_forward: softmax over [scores, sink] in fp32, the sink column dropped;
    # the G heads of a kv head as G query rows of it (row g r + t: head g of token t), K/V never repeated
    qg = qc.view(r, K, G, Dh).permute(1, 2, 0, 3).reshape(K, G * r, Dh).float()
    scores = (qg @ ks.float().transpose(1, 2)) * Dh ** -0.5  # [K, G r, L]
    scores = scores.view(K, G, r, L).masked_fill_(~seen, float("-inf")).view(K, G * r, L)
    sink = sinks.float().view(K, G, 1, 1).expand(-1, -1, r, -1).reshape(K, G * r, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [K, G r, L]
    return (probs @ vs.float()).view(K, G, r, Dh).permute(2, 0, 1, 3).reshape(r, H, Dh).to(qc.dtype)


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, seq_slots: torch.Tensor, seq_start: torch.Tensor,
                                cu_query: torch.Tensor, max_query_len: int, window: int = 0,
                                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch, same contract as ``paged_prefill_attention`` (and the engine's CPU path): per sequence, per
    query chunk (``_chunk_rows``: no score or mask tensor over MAX_SCORE_ELEMENTS), the chunk's keys
    [max(0, first - W + 1), last] gathered through the block table (without a window: the sequence's keys
    once, each chunk a prefix of them), then SDPA with a boolean mask and GQA; with sinks an explicit fp32
    softmax over [scores, sink] (``_attend_chunk``). Reads seq_slots / seq_start / cu_query on the host;
    max_query_len is not needed (the signature is the kernel's)."""
    _check("paged_prefill_attention_ref", q, k_cache, v_cache, block_table, seq_slots, seq_start, cu_query,
           max_query_len, window, sinks)
    o = torch.empty_like(q)
    cu = cu_query.tolist()
    for slot, start, q0, q1 in zip(seq_slots.tolist(), seq_start.tolist(), cu[:-1], cu[1:]):
        table, n, r0 = block_table[slot], q1 - q0, 0
        if not window:  # every chunk sees a prefix of the sequence's keys: gather them once, O(T) memory
            k_seq = _gather(k_cache, table, 0, start + n)  # [K, start + n, Dh]
            v_seq = _gather(v_cache, table, 0, start + n)
        while r0 < n:
            r = _chunk_rows(n - r0, start + r0, window, q.shape[1])
            first, last = start + r0, start + r0 + r - 1
            if window:  # the chunk's keys (first - W, last]
                lo = max(0, first - window + 1)
                ks, vs = _gather(k_cache, table, lo, last + 1), _gather(v_cache, table, lo, last + 1)
            else:
                lo, ks, vs = 0, k_seq[:, :last + 1], v_seq[:, :last + 1]
            o[q0 + r0:q0 + r0 + r] = _attend_chunk(q[q0 + r0:q0 + r0 + r], ks, vs, first, lo, window, sinks)
            r0 += r
    return o


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k/v [T, K, Dh] -> flat rows ``slot_mapping`` [T] int64 (= block * BS + offset) of k/v_cache
    [NB, BS, K, Dh] (the caches' first two dims must be viewable as one: a contiguous pool)."""
    K, Dh = k_cache.shape[2:]
    if (k.shape != v.shape or k.shape[1:] != (K, Dh) or v_cache.shape != k_cache.shape
            or slot_mapping.shape != k.shape[:1]):
        raise ValueError(f"write_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, caches {tuple(k_cache.shape)}/"
                         f"{tuple(v_cache.shape)}, slot_mapping {tuple(slot_mapping.shape)} do not fit [T, K, Dh], "
                         f"[NB, BS, K, Dh], [T]")
    k_cache.view(-1, K, Dh)[slot_mapping] = k
    v_cache.view(-1, K, Dh)[slot_mapping] = v

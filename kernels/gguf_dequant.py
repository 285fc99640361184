"""GGUF blocks decoded in Triton registers: the one place the MoE kernels (moe_gemv.py, moe_gemm.py) read
q4_K / q5_K / q6_K / q8_0 / mxfp4_gguf banks (layouts: services/engine/moe/gguf_quant.py, its reference).

Legend: E experts · D hidden · I expert intermediate · K a row's values · QK values per block.

``gguf_values(row_ptr, k, mask, QT)`` gives the fp32 weights at value index ``k`` of the rows at
``row_ptr`` (uint8 pointers), for any broadcastable pair of shapes: [R, 1] x [1, K] for a GEMV tile,
[1, N] x [K, 1] for a GEMM's transposed [BK, BN] tile. Each value loads the bytes it needs (its quant
bits, its sub-block's scale bytes, the block's fp16 d): a block's header is reloaded by each of its values,
but those loads hit L1 (a tile covers a few blocks per row), and DRAM reads each byte once. No lookup
tables, no host syncs, no data-dependent shapes: graph-capturable like the other formats.

Under the interpreter every byte is widened to int32 / fp32 at once (no bf16 arithmetic there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.engine.moe.gguf_quant import KERNEL_CODE, GGUFType, check_bank

# constexpr QT of the kernels (gguf_quant.KERNEL_CODE); 0 = not a GGUF bank
Q4_K, Q5_K, Q6_K, Q8_0, MXFP4_GGUF = (KERNEL_CODE[t] for t in (GGUFType.Q4_K, GGUFType.Q5_K, GGUFType.Q6_K,
                                                                GGUFType.Q8_0, GGUFType.MXFP4))


@triton.jit
def _byte(p, mask):
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """The little-endian fp16 at byte pointers p -> fp32 (two byte loads: any alignment)."""
    lo = tl.load(p, mask=mask, other=0).to(tl.uint16)
    hi = tl.load(p + 1, mask=mask, other=0).to(tl.uint16)
    return (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_at(p, mask, ALIGN: tl.constexpr):
    """The fp16 at byte pointers p, each a multiple of ALIGN -> fp32: one 16-bit load where ALIGN allows it."""
    if ALIGN == 1:
        return _f16(p, mask)
    return tl.load(p.to(tl.pointer_type(tl.uint16)), mask=mask, other=0).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def gguf_values(row_ptr, k, mask, QT: tl.constexpr):
    """fp32 weights at value indices k of the GGUF rows at row_ptr (broadcast together), 0 where ~mask."""
    if QT == 4:  # q8_0: d fp16 · q int8[32]
        base = row_ptr + (k // 32) * 34
        q = tl.load(base + 2 + k % 32, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return _f16(base, mask) * q
    elif QT == 5:  # mxfp4_gguf: e E8M0 · byte i holds values i (low nibble) and i + 16 (high)
        base = row_ptr + (k // 32) * 17
        i = k % 32
        b = _byte(base + 1 + i % 16, mask)
        nib = (b >> ((i // 16) * 4)) & 15
        # the nibble s|e1e0|m placed in an fp16's sign and exponent/mantissa bits 11..9 is e2m1 * 2**-14, exactly
        # (kernels/moe_gemv._e2m1); the E8M0 scale is made as an fp32 exponent field times 2**14
        v = (((nib & 7) << 9) | ((nib & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        e = _byte(base, mask)
        return v * (tl.minimum(e + 14, 255) << 23).to(tl.float32, bitcast=True)
    elif QT == 3:  # q6_K: ql[128] · qh[64] · int8 scales[16] · d fp16
        base = row_ptr + (k // 256) * 210
        i = k % 256
        h = i // 128
        r = i % 128
        lo = (_byte(base + 64 * h + r % 64, mask) >> ((r // 64) * 4)) & 15
        hi = (_byte(base + 128 + 32 * h + r % 32, mask) >> ((r // 32) * 2)) & 3
        sc = tl.load(base + 192 + i // 16, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return (_f16(base + 208, mask) * sc) * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:  # q4_K (QT 1) / q5_K (QT 2): d, dmin fp16 · 12 bytes of 6-bit (scale, min) · [qh[32]] · qs[128]
        BPB: tl.constexpr = 144 if QT == 1 else 176
        QS: tl.constexpr = 16 if QT == 1 else 48
        base = row_ptr + (k // 256) * BPB
        i = k % 256
        j = i // 32  # sub-block
        a = _byte(base + 4 + j % 4, mask)  # s[j % 4], s[j % 4 + 4], s[j % 4 + 8] (gguf_quant's unpacking)
        b = _byte(base + 8 + j % 4, mask)
        c = _byte(base + 12 + j % 4, mask)
        sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
        m = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
        q = (_byte(base + QS + (j // 2) * 32 + i % 32, mask) >> ((j % 2) * 4)) & 15
        if QT == 2:
            q |= ((_byte(base + 16 + i % 32, mask) >> j) & 1) << 4
        return (_f16(base, mask) * sc) * q.to(tl.float32) - _f16(base + 2, mask) * m


@triton.jit
def _k4_unpack(a, b, c, j):
    """q4_K / q5_K 6-bit (scale, min) of sub-blocks j (int tensor) from bytes j % 4, 4 + j % 4 and 8 + j % 4 of
    the 12 scale bytes (a, b, c) -> fp32 (sc, m)."""
    sc = tl.where(j < 4, a & 63, (c & 15) | ((a >> 6) << 4)).to(tl.float32)
    mn = tl.where(j < 4, b & 63, (c >> 4) | ((b >> 6) << 4)).to(tl.float32)
    return sc, mn


@triton.jit
def _k4_scale_min(sp, j, m3):
    """q4_K / q5_K 6-bit (scale, min) of sub-blocks j (int tensor) from the 12 bytes at sp -> fp32 (sc, m)."""
    return _k4_unpack(_byte(sp + j % 4, m3), _byte(sp + 4 + j % 4, m3), _byte(sp + 8 + j % 4, m3), j)


@triton.jit
def _words(base, word, mask, ALIGN: tl.constexpr):
    """The little-endian uint32 words ``word`` (ints, broadcast with base) of the bytes at ``base`` (byte
    pointers, each a multiple of ALIGN: 4, 2 or 1) -> uint32: one 32-bit load per word, two 16-bit or four
    byte loads (on the GPU a load wider than its address's alignment faults). Indexing in words, not bytes,
    lets the compiler see a thread's neighbouring words as contiguous and merge them into 128-bit loads."""
    if ALIGN == 4:
        return tl.load(base.to(tl.pointer_type(tl.uint32)) + word, mask=mask, other=0)
    elif ALIGN == 2:
        h = base.to(tl.pointer_type(tl.uint16)) + 2 * word
        return tl.load(h, mask=mask, other=0).to(tl.uint32) | (tl.load(h + 1, mask=mask, other=0).to(tl.uint32) << 16)
    else:
        p = base + 4 * word
        return (tl.load(p, mask=mask, other=0).to(tl.uint32) | (tl.load(p + 1, mask=mask, other=0).to(tl.uint32) << 8)
                | (tl.load(p + 2, mask=mask, other=0).to(tl.uint32) << 16)
                | (tl.load(p + 3, mask=mask, other=0).to(tl.uint32) << 24))


@triton.jit
def _x_quad(x_ptr, quad, X_ALIGN8: tl.constexpr):
    """x[4 quad .. 4 quad + 3] (quad an int tensor) -> a tuple of four fp32 tensors shaped like quad: the four
    inputs a quant word's bytes meet. With X_ALIGN8 (x_ptr a multiple of 8 bytes: the launcher's check) 16-bit x
    arrives in one 64-bit load per quad and fp32 x in two, not one load per value."""
    XT: tl.constexpr = x_ptr.dtype.element_ty
    if X_ALIGN8 and XT == tl.bfloat16:  # a bf16's bits are the top half of its fp32's: a shift, no convert
        v = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + quad)
        return (((v & 0xFFFF) << 16).to(tl.uint32).to(tl.float32, bitcast=True),
                ((v & 0xFFFF0000).to(tl.uint32)).to(tl.float32, bitcast=True),
                (((v >> 32) & 0xFFFF) << 16).to(tl.uint32).to(tl.float32, bitcast=True),
                ((v >> 32) & 0xFFFF0000).to(tl.uint32).to(tl.float32, bitcast=True))
    elif X_ALIGN8 and XT == tl.float16:
        v = tl.load(x_ptr.to(tl.pointer_type(tl.uint64)) + quad)
        return ((v & 0xFFFF).to(tl.uint16).to(XT, bitcast=True).to(tl.float32),
                ((v >> 16) & 0xFFFF).to(tl.uint16).to(XT, bitcast=True).to(tl.float32),
                ((v >> 32) & 0xFFFF).to(tl.uint16).to(XT, bitcast=True).to(tl.float32),
                (v >> 48).to(tl.uint16).to(XT, bitcast=True).to(tl.float32))
    elif X_ALIGN8 and XT == tl.float32:
        p = x_ptr.to(tl.pointer_type(tl.uint64)) + 2 * quad
        v01 = tl.load(p)
        v23 = tl.load(p + 1)
        return ((v01 & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
                (v01 >> 32).to(tl.uint32).to(tl.float32, bitcast=True),
                (v23 & 0xFFFFFFFF).to(tl.uint32).to(tl.float32, bitcast=True),
                (v23 >> 32).to(tl.uint32).to(tl.float32, bitcast=True))
    else:
        p = x_ptr + 4 * quad
        return (tl.load(p).to(tl.float32), tl.load(p + 1).to(tl.float32), tl.load(p + 2).to(tl.float32),
                tl.load(p + 3).to(tl.float32))


@triton.jit
def _uint_f32(q, OFFSET: tl.constexpr):
    """uint32 q < 2**23 -> fp32 q - OFFSET, exact, without a convert instruction (int -> float converts run at a
    fraction of the FMA rate on the GPU; one per weight would bound the kernel): q placed under the exponent
    of 2**23 is the float 2**23 + q, so one OR and one add."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + OFFSET)


@triton.jit
def _half_f32(w, HIGH: tl.constexpr):
    """The fp16 in the low (or HIGH) 16 bits of uint32 words w -> fp32."""
    bits = (w >> 16) if HIGH else (w & 0xFFFF)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k4_scale_min_words(s0, s1, s2, j):
    """q4_K / q5_K 6-bit (scale, min) of sub-blocks j (int tensor) from the 12 scale bytes held in the words
    s0, s1, s2 (uint32) -> fp32 (sc, m): byte j % 4 of each, unpacked as _k4_scale_min."""
    sh = (8 * (j % 4)).to(tl.uint32)
    return _k4_unpack((s0 >> sh) & 255, (s1 >> sh) & 255, (s2 >> sh) & 255, j)


@triton.jit
def gguf_row_dot(rows, mask_r, x_ptr, K, QT: tl.constexpr, BLOCK_R: tl.constexpr, ALIGN: tl.constexpr,
                 X_ALIGN8: tl.constexpr):
    """sum over k < K of W[r, k] * x[k] for the GGUF rows at ``rows`` ([BLOCK_R] uint8 pointers) -> [BLOCK_R]
    fp32: the GEMV's form of gguf_values. ALIGN (4, 2 or 1) divides every row's address (the launcher's
    check): the K-quants load their bytes as 32-bit words (16-bit or bytes where only that alignment holds;
    q6_K's 210-byte blocks are 2-aligned at best) and take a word's nibbles with shifts and masks; a word's
    four inputs x come packed in 64-bit loads where X_ALIGN8 says x_ptr is 8-byte aligned (_x_quad). Per 256
    values (a K-quant block, or 8 q8_0 / mxfp4 blocks) each quant byte is loaded once and split into both its
    values, a sub-block's scale is applied to its partial sum (sum (s q - o) x = s sum q x - o sum x), the
    block header is loaded once per row, and the K-quants keep one partial sum per word lane, so the only
    cross-thread sum is the last one."""
    r3 = rows[:, None, None]
    m3 = mask_r[:, None, None]
    if QT == 1 or QT == 2:  # q4_K / q5_K: byte 32g + l of qs holds values 64g + l (low) and 64g + 32 + l (high)
        BPB: tl.constexpr = 144 if QT == 1 else 176
        QS: tl.constexpr = 16 if QT == 1 else 48
        g = tl.arange(0, 4)[None, :, None]  # [1, 4, 1] group of 32 qs bytes: sub-blocks 2g (low) and 2g + 1
        w = tl.arange(0, 8)[None, None, :]  # [1, 1, 8] word of the group: bytes l = 4w + b
        acc = tl.zeros([BLOCK_R, 4, 8], dtype=tl.float32)
        for blk in range(0, K // 256):
            base = r3 + blk * BPB  # [R, 1, 1]; BPB is a multiple of 4: blocks keep the rows' alignment
            dd = _words(base, 0, m3, ALIGN)  # d, dmin
            s0 = _words(base, 1, m3, ALIGN)  # the 12 scale bytes
            s1 = _words(base, 2, m3, ALIGN)
            s2 = _words(base, 3, m3, ALIGN)
            qw = _words(base, QS // 4 + 8 * g + w, m3, ALIGN)  # [R, 4, 8]
            if QT == 2:  # the fifth bit: bit j of qh[l] for sub-block j
                qh = _words(base, 4 + w, m3, ALIGN)  # [R, 1, 8]
            x_lo4 = _x_quad(x_ptr, blk * 64 + 16 * g + w, X_ALIGN8)  # [1, 4, 8] values 64g + 4w + b of the block
            x_hi4 = _x_quad(x_ptr, blk * 64 + 16 * g + 8 + w, X_ALIGN8)  # 64g + 32 + 4w + b
            dq_lo = tl.zeros([BLOCK_R, 4, 8], dtype=tl.float32)
            dq_hi = tl.zeros([BLOCK_R, 4, 8], dtype=tl.float32)
            xs_lo = tl.zeros([1, 4, 8], dtype=tl.float32)
            xs_hi = tl.zeros([1, 4, 8], dtype=tl.float32)
            for b in tl.static_range(4):
                x_lo = x_lo4[b]
                x_hi = x_hi4[b]
                q_lo = (qw >> (8 * b)) & 15
                q_hi = (qw >> (8 * b + 4)) & 15
                if QT == 2:
                    q_lo |= ((qh >> (8 * b + 2 * g).to(tl.uint32)) & 1) << 4
                    q_hi |= ((qh >> (8 * b + 2 * g + 1).to(tl.uint32)) & 1) << 4
                dq_lo += _uint_f32(q_lo, 0) * x_lo
                dq_hi += _uint_f32(q_hi, 0) * x_hi
                xs_lo += x_lo
                xs_hi += x_hi
            d = _half_f32(dd, False)  # [R, 1, 1]
            dmin = _half_f32(dd, True)
            sc_lo, mn_lo = _k4_scale_min_words(s0, s1, s2, 2 * g)  # [R, 4, 1]
            sc_hi, mn_hi = _k4_scale_min_words(s0, s1, s2, 2 * g + 1)
            acc += ((d * sc_lo) * dq_lo - (dmin * mn_lo) * xs_lo + (d * sc_hi) * dq_hi - (dmin * mn_hi) * xs_hi)
        return tl.sum(tl.sum(acc, axis=2), axis=1)
    elif QT == 3:  # q6_K, half h of a block (128 values), byte l < 32 of a 32-byte run: ql[64h + l] holds values
        # 128h + l (low nibble) and + 64 (high), ql[64h + 32 + l] values + 32 and + 96, qh[32h + l] their 2-bit
        # highs (bits 2s for value 128h + 32s + l), whose scale is scales[8h + 2s + l // 16]
        A6: tl.constexpr = 2 if ALIGN == 4 else ALIGN  # odd blocks start 2 bytes past a multiple of 4
        h = tl.arange(0, 2)[None, :, None]  # [1, 2, 1]
        w = tl.arange(0, 8)[None, None, :]  # [1, 1, 8] word of the run: bytes l = 4w + b
        acc = tl.zeros([BLOCK_R, 2, 8], dtype=tl.float32)
        for blk in range(0, K // 256):
            base = r3 + blk * 210
            ql_a = _words(base, 16 * h + w, m3, A6)  # [R, 2, 8] ql bytes 64h + l
            ql_b = _words(base, 16 * h + 8 + w, m3, A6)  # 64h + 32 + l
            qh = _words(base, 32 + 8 * h + w, m3, A6)  # qh bytes 32h + l
            sw_a = _words(base, 48 + 2 * h, m3, A6)  # [R, 2, 1] scales 8h .. 8h + 3
            sw_b = _words(base, 49 + 2 * h, m3, A6)  # 8h + 4 .. 8h + 7
            part = tl.zeros([BLOCK_R, 2, 8], dtype=tl.float32)
            for s in tl.static_range(4):
                ql = ql_a if s % 2 == 0 else ql_b
                x4 = _x_quad(x_ptr, blk * 64 + 32 * h + 8 * s + w, X_ALIGN8)  # [1, 2, 8] values 128h + 32s + 4w + b
                dq = tl.zeros([BLOCK_R, 2, 8], dtype=tl.float32)
                for b in tl.static_range(4):
                    q = ((ql >> (8 * b + 4 * (s // 2))) & 15) | (((qh >> (8 * b + 2 * s)) & 3) << 4)
                    dq += _uint_f32(q, 32) * x4[b]
                sw = sw_a if s < 2 else sw_b
                sc = (sw >> (8 * (2 * (s % 2) + w // 4)).to(tl.uint32)) & 255  # [R, 2, 8] byte 2s + w // 4 of the 8
                part += _uint_f32(sc ^ 128, 128) * dq  # the int8 scale: its byte with the sign bit flipped is it + 128
            d = _f16_at(base + 208, m3, A6)  # [R, 1, 1] the fp16 d ends the block
            acc += d * part
        return tl.sum(tl.sum(acc, axis=2), axis=1)
    elif QT == 4:  # q8_0: 8 blocks of 32 values a step
        b = tl.arange(0, 8)
        v = tl.arange(0, 32)
        acc = tl.zeros([BLOCK_R, 8], dtype=tl.float32)
        for b0 in range(0, K // 32, 8):
            blk = b0 + b  # [8]
            mb = blk < K // 32
            x = tl.load(x_ptr + blk[:, None] * 32 + v[None, :], mask=mb[:, None], other=0.0).to(tl.float32)
            m3b = m3 & mb[None, :, None]
            q = tl.load(r3 + (blk[:, None] * 34 + 2 + v[None, :])[None, :, :], mask=m3b, other=0)
            dq = tl.sum(q.to(tl.int8, bitcast=True).to(tl.float32) * x[None, :, :], axis=2)  # [R, 8]
            acc += _f16(rows[:, None] + blk[None, :] * 34, mask_r[:, None] & mb[None, :]) * dq
        return tl.sum(acc, axis=1)
    else:  # mxfp4_gguf: 8 blocks of 32 a step; byte i holds values i (low nibble) and 16 + i (high)
        b = tl.arange(0, 8)
        v = tl.arange(0, 16)
        acc = tl.zeros([BLOCK_R, 8], dtype=tl.float32)
        for b0 in range(0, K // 32, 8):
            blk = b0 + b
            mb = blk < K // 32
            xo = blk[:, None] * 32 + v[None, :]  # [8, 16]
            x_lo = tl.load(x_ptr + xo, mask=mb[:, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_ptr + xo + 16, mask=mb[:, None], other=0.0).to(tl.float32)
            qb = _byte(r3 + (blk[:, None] * 17 + 1 + v[None, :])[None, :, :], m3 & mb[None, :, None])  # [R, 8, 16]
            lo = (((qb & 7) << 9) | ((qb & 8) << 12)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (((qb & 0x70) << 5) | ((qb & 0x80) << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
            part = tl.sum(lo * x_lo[None, :, :] + hi * x_hi[None, :, :], axis=2)  # [R, 8], 2**-14 times
            e = _byte(rows[:, None] + blk[None, :] * 17, mask_r[:, None] & mb[None, :])
            acc += part * (tl.minimum(e + 14, 255) << 23).to(tl.float32, bitcast=True)
        return tl.sum(acc, axis=1)


@triton.jit
def gguf_k4_group(rows, kg, mask, QT: tl.constexpr):
    """q4_K / q5_K: the 64 values kg .. kg + 63 (kg a multiple of 64: one group of qs bytes) of the rows at
    ``rows`` ([1, BN] uint8 pointers) -> (lo, hi) fp32 [32, BN]: values kg + l and kg + 32 + l. The GEMM's
    tile: each quant byte loaded once for both of its values, the sub-block scales once per column."""
    BPB: tl.constexpr = 144 if QT == 1 else 176
    QS: tl.constexpr = 16 if QT == 1 else 48
    base = rows + (kg // 256) * BPB  # [1, BN]
    gi = (kg % 256) // 64  # the group: sub-blocks 2 gi (low nibbles) and 2 gi + 1 (high)
    l = tl.arange(0, 32)[:, None]  # [32, 1]
    qb = _byte(base + QS + gi * 32 + l, mask)  # [32, BN]
    lo = qb & 15
    hi = qb >> 4
    if QT == 2:
        qh = _byte(base + 16 + l, mask)
        lo |= ((qh >> (2 * gi)) & 1) << 4
        hi |= ((qh >> (2 * gi + 1)) & 1) << 4
    d = _f16(base, mask)  # [1, BN]
    dmin = _f16(base + 2, mask)
    sc_lo, mn_lo = _k4_scale_min(base + 4, 2 * gi, mask)
    sc_hi, mn_hi = _k4_scale_min(base + 4, 2 * gi + 1, mask)
    return ((d * sc_lo) * lo.to(tl.float32) - dmin * mn_lo, (d * sc_hi) * hi.to(tl.float32) - dmin * mn_hi)


@triton.jit
def gguf_q6k_group(rows, kg, mask, BLOCK_N: tl.constexpr):
    """q6_K: the 64 values kg .. kg + 63 (kg a multiple of 64: j = kg % 256 / 64 = 2h + n takes nibble n of
    ql bytes 64h .. 64h + 63) of the rows at ``rows`` ([1, BN]) -> fp32 [64, BN], the 16-value scales
    loaded once per column."""
    base = rows + (kg // 256) * 210  # [1, BN]
    j = (kg % 256) // 64
    h = j // 2
    n = j % 2
    r = tl.arange(0, 64)[:, None]  # [64, 1]: values 128h + 64n + r
    lo = (_byte(base + 64 * h + r, mask) >> (4 * n)) & 15
    hi = (_byte(base + 128 + 32 * h + r % 32, mask) >> (2 * (2 * n + r // 32))) & 3
    sc = tl.load(base + 192 + 8 * h + 4 * n + tl.arange(0, 4)[:, None], mask=mask, other=0)
    s = _f16(base + 208, mask) * sc.to(tl.int8, bitcast=True).to(tl.float32)  # [4, BN] d * scale
    s64 = tl.reshape(tl.broadcast_to(s[:, None, :], [4, 16, BLOCK_N]), [64, BLOCK_N])  # each on its 16 values
    return s64 * ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def _gdot(a, b, IEEE: tl.constexpr):
    if IEEE:  # fp32 operands: no tf32 rounding
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def gguf_group_dot(x_ptrs, x_mask, rows, kg, mask, QT: tl.constexpr, CDT: tl.constexpr, IEEE: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """The grouped GEMM's k-quant step: X[:, kg:kg + 64] @ W[:, kg:kg + 64]^T -> fp32 [BM, BN], with x_ptrs
    [BM, 1] pointing at value kg of each input row (x_mask [BM, 1]) and rows [1, BN] at the weight rows.
    q4_K / q5_K: two dots, the quant bytes' low nibbles with x's first 32 values and the high with the
    next 32; q6_K: one dot."""
    if QT == 3:
        x = tl.load(x_ptrs + tl.arange(0, 64)[None, :], mask=x_mask, other=0.0)  # [BM, 64]
        return _gdot(x, gguf_q6k_group(rows, kg, mask, BLOCK_N).to(CDT), IEEE)
    l32 = tl.arange(0, 32)[None, :]
    x_lo = tl.load(x_ptrs + l32, mask=x_mask, other=0.0)  # [BM, 32] values kg + l
    x_hi = tl.load(x_ptrs + 32 + l32, mask=x_mask, other=0.0)  # kg + 32 + l
    wl, wh = gguf_k4_group(rows, kg, mask, QT)
    return _gdot(x_lo, wl.to(CDT), IEEE) + _gdot(x_hi, wh.to(CDT), IEEE)


def gguf_geometry(what: str, hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  gguf_types) -> tuple[int, int, int, int]:
    """GGUF banks gate_up uint8 [E, 2I, >= row_bytes(gate_up type, D)] and down uint8 [E, D, >= row_bytes(down
    type, I)] beside hidden [T, D], ``gguf_types`` = (gate_up's type, down's type) -> (D, I, gate_up's QT,
    down's QT). Rows may be wider than their type needs (padded slots: gguf_quant.check_bank); the kernels
    step rows by the tensor's stride. ValueError naming the shapes otherwise."""
    gt, dt = (GGUFType(t) for t in gguf_types)
    D = hidden.shape[-1]
    E, two_i = gate_up.shape[0], gate_up.shape[1]
    I = two_i // 2
    try:
        check_bank("gate_up", gate_up, gt, 2 * I, D)
        check_bank("down", down, dt, D, I)
        if down.shape[0] != E or two_i % 2:
            raise ValueError(f"{E} experts of gate_up, {down.shape[0]} of down; {two_i} gate_up rows")
    except ValueError as e:
        raise ValueError(f"{what}: GGUF banks gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} with hidden "
                         f"{tuple(hidden.shape)} are not [E, 2I, row_bytes(D)], [E, D, row_bytes(I)]: {e}") from e
    return D, I, KERNEL_CODE[gt], KERNEL_CODE[dt]

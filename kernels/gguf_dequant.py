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

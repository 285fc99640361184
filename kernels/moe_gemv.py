"""moe_gemv: the routed experts of a decode step (few routes), reading each expert's weights in place.

Dimension legend: T tokens · A experts per token · R = T*A routes · E experts (or cache slots) ·
D hidden · I expert intermediate.

Why: the torch decode path gathers the R experts' weights into a new [R, ...] tensor before two bmm
(read + write + read again: 3x the bytes), because torch cannot index a matmul operand by a device
tensor without copying. These two GEMV kernels read ``gate_up[e]`` / ``down[e]`` straight from the
bank, with ``e`` loaded on the device: no host sync, fixed grid, capturable in a CUDA graph.

    act[r, :] = silu(gate_up[e_r, :I] @ x_t) * (gate_up[e_r, I:] @ x_t)          kernel 1, fp32
    y[r, :]   = w_r * (down[e_r] @ act[r])                                        kernel 2, fp32
    out[t, :] = sum over the A routes of token t of y, cast to hidden's dtype     kernel 3

Routes with e_r < 0 (computed elsewhere, e.g. by the CPU in hybrid mode) write zeros.

gpt-oss experts (``act`` = ClampedSwiGLU, ``bias``): gate_up_bias[e_r] is added to the gate / up sums and
down_bias[e_r] to y before the routing weight, and kernel 1 applies (clamp(u, +-7) + 1) * g * sigmoid(1.702 g)
with g = min(gate, 7) (constexpr switches: the plain experts' kernels are unchanged).
The reference is ``services.engine.moe.reference.moe_reference``; tests/kernels/test_moe_gemv.py.

FP8 experts (fp8_block banks, services/engine/moe/fp8.py): the same kernels read float8_e4m3fn weights
and multiply each element by its 128x128 block's fp32 scale in registers (a scale load per element
hits L1: a [16, 256] tile touches at most 2 x 3 scales), so no dequantized copy of an expert exists;
the reference is fp8.dequantize + moe_reference (tests/kernels/test_moe_gemv_fp8.py).

MXFP4 experts (gpt-oss's Hub format kept as is: uint8 banks, 32 e2m1 values per E8M0 scale): the kernels
read the packed bytes (half a byte per weight: gpt-oss-120b's 4 routed experts of a layer are ~52 MB
instead of ~200 MB of bf16) and decode them in registers without a lookup table (``_e2m1``: a
nibble's bits placed in an fp16 give the value exactly, times 2**-14), sum each 32-value block's products,
then multiply by the block's scale, built as an fp32 exponent field (exact). The even and odd weights of
a byte meet x's even and odd elements, so nothing is interleaved. The reference is models/mxfp4.dequantize
+ moe_reference (tests/kernels/test_moe_gemv_gpt_oss.py, which also checks hand-computed values).

GGUF experts (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf: services/engine/moe/gguf_quant.py): uint8 banks of the
file's blocks, no scale banks; the caller names each bank's type (``gguf_types``: gate_up and down may
differ, Q4_K_M files hold q6_K down) and rows may be wider than the type needs (slots shared by layers of
different types). kernels/gguf_dequant.gguf_row_dot decodes each row's blocks in registers, every quant
byte loaded once and each sub-block's scale applied to its partial sum (constexpr QT per bank); it loads
32-bit words where every row of the bank is 4-byte aligned (constexpr ALIGN: row_alignment checks the bank's
address and strides; padded rows may not be). Rows per program and num_warps come from GGUF_LAUNCH by type.
The reference is gguf_quant.dequantize + moe_reference (tests/kernels/test_moe_gguf.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gguf_dequant import gguf_geometry, gguf_row_dot
from services.engine.moe.gguf_quant import GGUFType

# Kernel 1 programs: (route, BLOCK_I rows of gate and of up). Qwen3-30B-A3B (I=768, D=2048), R=8:
# 384 programs of 128 KiB of bf16 weights each — enough in flight to stream HBM on 132 SMs.
BLOCK_I, BLOCK_K1 = 16, 256
# Kernel 2 programs: (route, BLOCK_D output rows), each reading BLOCK_D x I weights.
BLOCK_D, BLOCK_K2 = 32, 256
# Combine programs: (token, BLOCK_C outputs), each summing A fp32 rows (tiny: T*A*D*4 bytes in all).
BLOCK_C = 256


@dataclass(frozen=True)
class RowLaunch:
    """How a GEMV kernel is launched on GGUF banks: ``rows`` per program (kernel 1: rows of gate and of up;
    kernel 2: output rows) and ``num_warps``."""

    rows: int
    num_warps: int = 4


# GGUF banks: type -> (kernel 1's launch when gate_up is of that type, kernel 2's when down is). A tuning table:
# python -m benchmarks.bench_moe_gemm --gguf TYPES --gemv-sweep times the candidates on a device. Swept on the
# H200 (2026-12-05, a Qwen3-30B-A3B Q4_K_M layer, one token): q4_K's gate_up and q6_K's down at 8 rows x 2 warps,
# 28.8 and 25.9 us for the layer against 29.9 and 28.8 at bf16's launches; the types not swept yet keep those.
GGUF_LAUNCH: dict[GGUFType, tuple[RowLaunch, RowLaunch]] = {
    t: (RowLaunch(BLOCK_I), RowLaunch(BLOCK_D)) for t in GGUFType
}
GGUF_LAUNCH[GGUFType.Q4_K] = (RowLaunch(8, num_warps=2), GGUF_LAUNCH[GGUFType.Q4_K][1])
GGUF_LAUNCH[GGUFType.Q6_K] = (GGUF_LAUNCH[GGUFType.Q6_K][0], RowLaunch(8, num_warps=2))


SCALE_BLOCK = 128  # fp8_block: the edge of a scale's block (fp8.BLOCK)
MX_BLOCK = 32  # mxfp4: values per E8M0 scale (models/mxfp4.BLOCK); 16 bytes of packed e2m1
# Weight formats (constexpr QUANT): bank dtype bf16/fp32, float8_e4m3fn + fp32 block scales, uint8 MXFP4,
# uint8 GGUF blocks (their type in the constexpr QT: kernels/gguf_dequant.py)
PLAIN, FP8, MXFP4, GGUF = 0, 1, 2, 3


@triton.jit
def _e2m1(b):
    """b uint8 (two e2m1 per byte: element 2j low nibble, 2j+1 high) -> (low, high) fp32, each 2**-14 times
    the value. A nibble s|e1e0|m is placed in an fp16 as sign bit 15 and exponent/mantissa bits 11..9: that
    fp16 is exactly e2m1 * 2**-14 (normal for e > 0, the subnormal m * 2**-15 for e = 0: 0.5 * 2**-14), so
    no lookup table is needed; fp16 -> fp32 is exact."""
    b = b.to(tl.uint16)
    lo = (((b & 0x07) << 9) | ((b & 0x08) << 12)).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (((b & 0x70) << 5) | ((b & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _e8m0_scale(s):
    """E8M0 exponents uint8 [...] -> 2**(s - 127) * 2**14 fp32 (the 2**14 that _e2m1 leaves out), made as
    an fp32 exponent field, so exact: s + 14 fits the field up to s = 240 (2**113; real scales sit near 127)."""
    return (tl.minimum(s.to(tl.int32) + 14, 255) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _mx_row_dot(w_ptr, s_ptr, offs_r, mask_r, stride_wr, stride_sr, v_ptr, KB,
                BLOCK_R: tl.constexpr, BLOCK_KB: tl.constexpr):
    """sum over k of W[r, k] * v[k] for MXFP4 rows r = offs_r: W's packed bytes at w_ptr [rows, KB] and
    its scales at s_ptr [rows, KB/16], v at v_ptr [2*KB] -> [BLOCK_R] fp32. Tiles are [rows, blocks, 16
    bytes], so a thread holds whole 16-byte blocks (one vector load): each block's products are summed in
    registers, scaled once, and kept per block; the only cross-thread sum is the last one."""
    NBLK: tl.constexpr = BLOCK_KB // 16
    acc = tl.zeros([BLOCK_R, NBLK], dtype=tl.float32)
    offs_j = tl.arange(0, 16)
    for k0 in range(0, KB, BLOCK_KB):
        offs_blk = k0 // 16 + tl.arange(0, NBLK)  # [NBLK] scale blocks (KB is a multiple of 16)
        mask_blk = offs_blk < KB // 16
        byte = offs_blk[:, None] * 16 + offs_j[None, :]  # [NBLK, 16] byte columns
        ve = tl.load(v_ptr + 2 * byte, mask=mask_blk[:, None], other=0.0).to(tl.float32)  # elements 2j
        vo = tl.load(v_ptr + 2 * byte + 1, mask=mask_blk[:, None], other=0.0).to(tl.float32)  # elements 2j + 1
        m = mask_r[:, None] & mask_blk[None, :]  # [R, NBLK]
        b = tl.load(w_ptr + offs_r[:, None, None] * stride_wr + byte[None, :, :], mask=m[:, :, None], other=0)
        lo, hi = _e2m1(b)  # [R, NBLK, 16]
        part = tl.sum(lo * ve[None, :, :] + hi * vo[None, :, :], axis=2)  # [R, NBLK]
        s = tl.load(s_ptr + offs_r[:, None] * stride_sr + offs_blk[None, :], mask=m, other=0)
        acc += part * _e8m0_scale(s)
    return tl.sum(acc, axis=1)


@triton.jit
def _gate_up_act_kernel(
    # pointers (gs_ptr: fp8 scales [E, 2*ceil(I/128), ceil(D/128)] or mxfp4 scales [E, 2I, D/32], unused
    # when PLAIN; gb_ptr: gate_up_bias [E, 2I], unused unless BIAS)
    x_ptr, ids_ptr, gate_up_ptr, act_ptr, gs_ptr, gb_ptr,
    # sizes (NB = ceil(I/128): the first fp8 scale row of up) · clamped SwiGLU's alpha and limit
    A, D, I, NB, alpha, limit,
    # strides (elements)
    stride_x, stride_ge, stride_gr, stride_act, stride_gse, stride_gsr, stride_gbe,
    # meta
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, SB: tl.constexpr,
    BIAS: tl.constexpr, CLAMP: tl.constexpr, QT: tl.constexpr, ALIGN: tl.constexpr, X_ALIGN8: tl.constexpr,
):
    r = tl.program_id(0)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] rows of gate (and of up)
    mask_i = offs_i < I
    e = tl.load(ids_ptr + r)
    t = r // A
    acc_g = tl.zeros([BLOCK_I], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_I], dtype=tl.float32)
    if e >= 0:
        base = gate_up_ptr + e.to(tl.int64) * stride_ge
        if QUANT == 2:  # MXFP4: D/2 bytes per row, BLOCK_K elements = BLOCK_K/2 bytes a step
            sbase = gs_ptr + e.to(tl.int64) * stride_gse
            acc_g = _mx_row_dot(base, sbase, offs_i, mask_i, stride_gr, stride_gsr, x_ptr + t * stride_x,
                                D // 2, BLOCK_I, BLOCK_K // 2)
            acc_u = _mx_row_dot(base, sbase, offs_i + I, mask_i, stride_gr, stride_gsr, x_ptr + t * stride_x,
                                D // 2, BLOCK_I, BLOCK_K // 2)
        elif QUANT == 3:  # GGUF: gate's rows and up's (I rows further), blocks decoded in registers
            rows = base + offs_i.to(tl.int64) * stride_gr  # [BLOCK_I] row pointers
            acc_g = gguf_row_dot(rows, mask_i, x_ptr + t * stride_x, D, QT, BLOCK_I, ALIGN, X_ALIGN8)
            acc_u = gguf_row_dot(rows + I * stride_gr, mask_i, x_ptr + t * stride_x, D, QT, BLOCK_I, ALIGN, X_ALIGN8)
        else:
            for k0 in range(0, D, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < D
                x = tl.load(x_ptr + t * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
                m = mask_i[:, None] & mask_k[None, :]
                wg = tl.load(base + offs_i[:, None] * stride_gr + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
                wu = tl.load(base + (offs_i[:, None] + I) * stride_gr + offs_k[None, :], mask=m,
                             other=0.0).to(tl.float32)
                if QUANT == 1:  # fp8: gate's block rows, then up's from NB on
                    sbase = gs_ptr + e.to(tl.int64) * stride_gse + (offs_k // SB)[None, :]
                    wg *= tl.load(sbase + (offs_i // SB)[:, None] * stride_gsr, mask=m, other=0.0)
                    wu *= tl.load(sbase + (NB + offs_i // SB)[:, None] * stride_gsr, mask=m, other=0.0)
                acc_g += tl.sum(wg * x[None, :], axis=1)
                acc_u += tl.sum(wu * x[None, :], axis=1)
        if BIAS:
            bias = gb_ptr + e.to(tl.int64) * stride_gbe
            acc_g += tl.load(bias + offs_i, mask=mask_i, other=0.0).to(tl.float32)
            acc_u += tl.load(bias + I + offs_i, mask=mask_i, other=0.0).to(tl.float32)
    if CLAMP:  # gpt-oss (reference.ClampedSwiGLU): (clamp(u, +-limit) + 1) * g * sigmoid(alpha g), g <= limit
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))  # zeros for skipped routes (g = u = 0)
    else:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(g) * u; zeros for skipped routes
    tl.store(act_ptr + r * stride_act + offs_i, act, mask=mask_i)


@triton.jit
def _down_kernel(
    # pointers (ds_ptr: fp8 scales [E, ceil(D/128), ceil(I/128)] or mxfp4 scales [E, D, I/32], unused when
    # PLAIN; db_ptr: down_bias [E, D], unused unless BIAS)
    act_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, ds_ptr, db_ptr,
    # sizes
    D, I,
    # strides (elements)
    stride_act, stride_de, stride_dr, stride_y, stride_dse, stride_dsr, stride_dbe,
    # meta
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, QUANT: tl.constexpr, SB: tl.constexpr, BIAS: tl.constexpr,
    QT: tl.constexpr, ALIGN: tl.constexpr, X_ALIGN8: tl.constexpr,
):
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] output rows
    mask_d = offs_d < D
    e = tl.load(ids_ptr + r)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if e >= 0:
        base = down_ptr + e.to(tl.int64) * stride_de
        if QUANT == 2:  # MXFP4: I/2 bytes per row
            acc = _mx_row_dot(base, ds_ptr + e.to(tl.int64) * stride_dse, offs_d, mask_d, stride_dr, stride_dsr,
                              act_ptr + r * stride_act, I // 2, BLOCK_D, BLOCK_K // 2)
        elif QUANT == 3:  # GGUF rows of I values
            acc = gguf_row_dot(base + offs_d.to(tl.int64) * stride_dr, mask_d, act_ptr + r * stride_act, I, QT, BLOCK_D,
                               ALIGN, X_ALIGN8)
        else:
            for k0 in range(0, I, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < I
                a = tl.load(act_ptr + r * stride_act + offs_k, mask=mask_k, other=0.0)  # [BLOCK_K] fp32
                m = mask_d[:, None] & mask_k[None, :]
                wd = tl.load(base + offs_d[:, None] * stride_dr + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
                if QUANT == 1:
                    wd *= tl.load(ds_ptr + e.to(tl.int64) * stride_dse + (offs_d // SB)[:, None] * stride_dsr
                                  + (offs_k // SB)[None, :], mask=m, other=0.0)
                acc += tl.sum(wd * a[None, :], axis=1)
        if BIAS:  # before the routing weight, as the reference
            acc += tl.load(db_ptr + e.to(tl.int64) * stride_dbe + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc = acc * tl.load(w_ptr + r).to(tl.float32)
    tl.store(y_ptr + r * stride_y + offs_d, acc, mask=mask_d)


@triton.jit
def _combine_kernel(
    y_ptr, out_ptr,
    A, D,
    stride_y, stride_out,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for a in range(0, A):  # in route order, like the [T, A, D] sum of the reference
        acc += tl.load(y_ptr + (t * A + a) * stride_y + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check_scales(gate_up_scale, down_scale, want_gu, want_d, what: str, layout: str) -> None:
    if (down_scale is None or tuple(gate_up_scale.shape) != want_gu or tuple(down_scale.shape) != want_d
            or gate_up_scale.stride(2) != 1 or down_scale.stride(2) != 1):
        raise ValueError(f"moe_gemv: {what} scales gate_up_scale {tuple(gate_up_scale.shape)}, down_scale "
                         f"{None if down_scale is None else tuple(down_scale.shape)} do not match {layout} = "
                         f"{want_gu} and {want_d} (contiguous last dimension)")


def moe_gemv(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None, act=None,
             bias: tuple[torch.Tensor, torch.Tensor] | None = None, gguf_types=None,
             gguf_launch: tuple[RowLaunch, RowLaunch] | None = None) -> torch.Tensor:
    """hidden [T, D] · topk_ids [T, A] int (-1 = skip) · topk_weights [T, A] · gate_up [E, 2I, D] ·
    down [E, D, I] -> [T, D] in hidden's dtype (fp32 accumulation). Same contract as moe_reference.
    FP8 banks: gate_up and down float8_e4m3fn with gate_up_scale [E, 2*ceil(I/128), ceil(D/128)] and
    down_scale [E, ceil(D/128), ceil(I/128)] fp32 (services/engine/moe/fp8.py).
    MXFP4 banks (told apart by their uint8 weights): gate_up [E, 2I, D/2] and down [E, D, I/2] packed
    e2m1, gate_up_scale [E, 2I, D/32] and down_scale [E, D, I/32] uint8 E8M0 (D and I multiples of 32).
    GGUF banks (``gguf_types`` = (gate_up's, down's) GGUFType or its value, e.g. ("q4_K", "q6_K"); no
    scales): gate_up [E, 2I, >= row_bytes(D)], down [E, D, >= row_bytes(I)] uint8 in the file's blocks;
    ``gguf_launch`` (kernel 1's, kernel 2's RowLaunch) replaces GGUF_LAUNCH's entries (the benchmark's sweep).
    gpt-oss experts: ``act`` a ClampedSwiGLU (its alpha and limit are read), ``bias`` (gate_up_bias [E, 2I],
    down_bias [E, D])."""
    T, A = topk_ids.shape
    if gguf_types is not None:
        return _moe_gemv_gguf(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gguf_types, gguf_launch)
    if gate_up.dtype == torch.uint8 and gate_up_scale is None:  # never guessed from the shape: rows may be padded
        raise ValueError("moe_gemv: uint8 banks without scales are GGUF banks: pass gguf_types (MXFP4 banks: "
                         "their gate_up_scale / down_scale)")
    mx = gate_up.dtype == torch.uint8
    E, two_i = gate_up.shape[:2]
    I = two_i // 2
    D = gate_up.shape[2] * (2 if mx else 1)
    want_d = (E, D, I // 2) if mx else (E, D, I)
    if hidden.shape != (T, D) or tuple(down.shape) != want_d or topk_weights.shape != (T, A):
        raise ValueError(f"moe_gemv: shapes hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} do not match [T, D], [T, A], [T, A], [E, 2I, D], [E, D, I]"
                         + (" (MXFP4: D and I halved in the last dimension)" if mx else ""))
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("moe_gemv: gate_up and down need a contiguous last dimension")
    nb, nd = -(-I // SCALE_BLOCK), -(-D // SCALE_BLOCK)
    if mx:
        if D % MX_BLOCK or I % MX_BLOCK or gate_up_scale is None:
            raise ValueError(f"moe_gemv: MXFP4 banks need D ({D}) and I ({I}) multiples of {MX_BLOCK} and "
                             "gate_up_scale / down_scale (GGUF banks: gguf_types)")
        _check_scales(gate_up_scale, down_scale, (E, 2 * I, D // MX_BLOCK), (E, D, I // MX_BLOCK), "mxfp4",
                      "[E, 2I, D/32] and [E, D, I/32]")
        quant = MXFP4
    elif gate_up_scale is not None:
        _check_scales(gate_up_scale, down_scale, (E, 2 * nb, nd), (E, nd, nb), "fp8",
                      "[E, 2*ceil(I/128), ceil(D/128)] and [E, ceil(D/128), ceil(I/128)]")
        quant = FP8
    else:
        quant = PLAIN
    scales = (gate_up_scale, down_scale) if quant != PLAIN else None
    return _launch(hidden, topk_ids, topk_weights, gate_up, down, act, bias, D, I, quant, scales, nb)


def _launch(hidden, topk_ids, topk_weights, gate_up, down, act, bias, D: int, I: int, quant: int, scales=None,
            nb: int = 0, qts: tuple[int, int] = (0, 0),
            launch: tuple[RowLaunch, RowLaunch] = (RowLaunch(BLOCK_I), RowLaunch(BLOCK_D))) -> torch.Tensor:
    """The three kernels of moe_gemv on checked banks: ``scales`` (gate_up's, down's) for FP8 / MXFP4, ``qts``
    the two banks' GGUF type codes (QUANT=GGUF), ``launch`` kernel 1's and kernel 2's rows per program and warps."""
    T, A = topk_ids.shape
    E = gate_up.shape[0]
    if bias is not None and (tuple(bias[0].shape) != (E, 2 * I) or tuple(bias[1].shape) != (E, D)
                             or bias[0].stride(1) != 1 or bias[1].stride(1) != 1):
        raise ValueError(f"moe_gemv: biases {tuple(bias[0].shape)}, {tuple(bias[1].shape)} do not match "
                         f"[E, 2I] = {(E, 2 * I)} and [E, D] = {(E, D)} (contiguous last dimension)")
    gs, ds = scales if scales is not None else (gate_up, down)  # not read without scales
    # GGUF banks pass zero scale strides (their scales live inside the blocks); the others the tensors' own
    gss, dss = ((0, 0), (0, 0)) if quant == GGUF else ((gs.stride(0), gs.stride(1)), (ds.stride(0), ds.stride(1)))
    gb, db = bias if bias is not None else (gate_up, down)  # not read without biases
    hidden = hidden.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [R]
    weights = topk_weights.reshape(-1).contiguous()  # [R]
    R = ids.numel()
    inter = torch.empty((R, I), dtype=torch.float32, device=hidden.device)  # [R, I] activations
    y = torch.empty((R, D), dtype=torch.float32, device=hidden.device)  # [R, D]
    l1, l2 = launch
    _gate_up_act_kernel[(R, triton.cdiv(I, l1.rows))](
        hidden, ids, gate_up, inter, gs, gb,
        A, D, I, nb, float(act.alpha) if act is not None else 0.0, float(act.limit) if act is not None else 0.0,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), inter.stride(0), *gss, gb.stride(0),
        BLOCK_I=l1.rows, BLOCK_K=BLOCK_K1, QUANT=quant, SB=SCALE_BLOCK, BIAS=bias is not None, CLAMP=act is not None,
        QT=qts[0], ALIGN=row_alignment(gate_up) if quant == GGUF else 1,
        X_ALIGN8=quant == GGUF and _rows_8_aligned(hidden), num_warps=l1.num_warps,
    )
    _down_kernel[(R, triton.cdiv(D, l2.rows))](
        inter, ids, weights, down, y, ds, db,
        D, I,
        inter.stride(0), down.stride(0), down.stride(1), y.stride(0), *dss, db.stride(0),
        BLOCK_D=l2.rows, BLOCK_K=BLOCK_K2, QUANT=quant, SB=SCALE_BLOCK, BIAS=bias is not None, QT=qts[1],
        ALIGN=row_alignment(down) if quant == GGUF else 1, X_ALIGN8=quant == GGUF and _rows_8_aligned(inter),
        num_warps=l2.num_warps,
    )
    return _combine(y, T, A, D, hidden.dtype)


def row_alignment(bank: torch.Tensor) -> int:
    """The largest of 4, 2, 1 that divides the address of every row of a uint8 bank [E, rows, bytes] (its base
    address and its two outer strides): the widest load gguf_row_dot may use at a row's word offsets."""
    bits = bank.data_ptr() | bank.stride(0) | bank.stride(1)
    return 4 if bits % 4 == 0 else 2 if bits % 2 == 0 else 1


def _rows_8_aligned(x: torch.Tensor) -> bool:
    """Whether every row of the 2-d ``x`` starts at a multiple of 8 bytes (the GGUF path's packed input loads)."""
    return (x.data_ptr() | x.stride(0) * x.element_size()) % 8 == 0


def _combine(y: torch.Tensor, T: int, A: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty((T, D), dtype=dtype, device=y.device)  # [T, D]
    _combine_kernel[(T, triton.cdiv(D, BLOCK_C))](  # sum over the A routes + cast: one launch, not two
        y, out, A, D, y.stride(0), out.stride(0), BLOCK=BLOCK_C,
    )
    return out


def _moe_gemv_gguf(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gguf_types,
                   gguf_launch=None) -> torch.Tensor:
    """moe_gemv on GGUF banks (its docstring): the same three kernels with QUANT=GGUF, each bank's QT and its
    type's launch (GGUF_LAUNCH, or ``gguf_launch``)."""
    T, A = topk_ids.shape
    D, I, gt, dt = gguf_geometry("moe_gemv", hidden, gate_up, down, gguf_types)
    if hidden.shape != (T, D) or topk_weights.shape != (T, A):
        raise ValueError(f"moe_gemv: shapes hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)} do not match [T, D], [T, A], [T, A]")
    if gguf_launch is None:
        gate_up_type, down_type = (GGUFType(t) for t in gguf_types)
        gguf_launch = (GGUF_LAUNCH[gate_up_type][0], GGUF_LAUNCH[down_type][1])
    return _launch(hidden, topk_ids, topk_weights, gate_up, down, act, bias, D, I, GGUF, qts=(gt, dt),
                   launch=gguf_launch)

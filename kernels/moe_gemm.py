"""moe_gemm: the routed experts of a step with many routes (batched decode, prefill), each expert's weights
read once per BLOCK_M routes instead of once per route.

Dimension legend: T tokens · A experts per token · R = T*A routes · E experts (or cache slots) ·
D hidden · I expert intermediate · M = NT*BLOCK_M padded rows · NT tiles.

Why: the GEMV (kernels/moe_gemv.py) reads ``gate_up[e]`` / ``down[e]`` once per route. At 16 decode
streams of Qwen3-30B-A3B (top-8 of 128) a layer has 128 routes over ~81 distinct experts: 128 x 9.4 MB
read instead of 81 x 9.4 MB, and a 4 x 60-token prefill (1920 routes over <= 128 experts) reads 18 GB per
layer instead of 1.2 GB. Here the routes are grouped by expert into tiles of BLOCK_M rows (the idea of
vLLM's fused_moe); a program multiplies one tile by a BLOCK_N slice of its expert on the tensor cores.

    align:  routes [M] (route index per padded row, R = padding) · tile_expert [NT] (-1 = unused tile);
            kernels/moe_align.py
    act[m, :] = glu(x[tok(m)] @ gate_up[e]^T (+ bias))                     kernel 1, stored in x's dtype
    y[r, :]   = w_r * (act[m(r)] @ down[e]^T (+ bias))                     kernel 2, fp32, by route
    out[t, :] = sum over the A routes of t (skipped ones left out), cast   kernel 3

Static shapes and no host sync (CUDA-graph capturable): the tile count is padded to its upper bound
NT = ceil(R / BLOCK_M) + min(E, R) (each expert present wastes at most one partial tile); unused tiles
exit at once. Routes with expert id -1 (computed elsewhere: the CPU in hybrid, another chunk in offload)
get no row and contribute nothing.

Weights: bf16/fp32 banks, or fp8_block (float8_e4m3fn + fp32 scale per 128x128 block, moe/fp8.py):
BLOCK_K divides 128, so a k-step of a BLOCK_N slice meets one scale per row; the fp8 codes go through the
tensor cores in x's dtype (exact: every e4m3 value is a bf16 value) and the partial product is scaled in
fp32 before it is accumulated. MXFP4 banks (uint8: packed e2m1 rows, one E8M0 byte per 32 values; the
format of kernels/moe_gemv.py): ``_load_mx`` decodes a tile of bytes into its even and odd weights, scaled
and exact in x's dtype (2 significant bits), and they meet x's even and odd columns in two dots, so
nothing is interleaved; BLOCK_K is then a multiple of 32. GGUF banks (uint8 blocks without scale banks,
each bank's type named by ``gguf_types``, rows possibly padded: services/engine/moe/gguf_quant.py): kernels/gguf_dequant.gguf_values
decodes each [BK, BN] tile in registers into x's dtype (constexpr GQ per bank: gate_up and down may
differ); the K-quants take 64-value groups when BLOCK_K is a multiple of 64 (gguf_dequant.gguf_group_dot:
q4_K / q5_K's quant bytes loaded once, their nibbles into two dots like MXFP4's even/odd; the scales once
per column), any BLOCK_K and the per-value decode otherwise. gpt-oss experts: per-expert biases and the
clamped SwiGLU (moe/reference.py).

Triton specializes int arguments on ==1 and %16: the sizes that change per step (R) are
``do_not_specialize``, so one compile per (dtype, format, activation, config) serves every step size.
The reference is ``services.engine.moe.reference.moe_reference``; ``moe_gemm_torch`` below is the same
tile algorithm in torch (tests/kernels/test_moe_gemm.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.gguf_dequant import gguf_geometry, gguf_group_dot, gguf_values
from kernels.moe_align import _count_kernel, _place_kernel, align_routes, num_tiles  # noqa: F401 - re-exported
from kernels.moe_gemv import MX_BLOCK, _e2m1, _e8m0_scale

SCALE_BLOCK = 128  # fp8_block: the edge of a scale's block (fp8.BLOCK)


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. ``block_k`` / ``block_k2`` divide 128 (one fp8 scale per k-step)."""

    block_m: int  # routes per tile (>= 16: tl.dot's smallest M)
    block_n: int  # kernel 1: rows of gate (and of up) per program
    block_k: int  # kernel 1: D per k-step
    block_n2: int  # kernel 2: output rows (of D) per program
    block_k2: int  # kernel 2: I per k-step
    num_warps: int = 4
    num_stages: int = 3


# Launch configs: device key -> ((most routes per expert on average, R / E, config), ...), the first that fits.
# Few routes per expert (decode): 16-row tiles and narrow N slices, so enough programs stream HBM (Qwen3-30B-A3B
# at 4 streams: ~28 experts x 24 slices of gate_up). Many (long prefills): 64-row tiles reuse each weight tile
# 4x more. A tuned device gets its own key (``device_key``); benchmarks/bench_moe_gemm.py --sweep prints the
# best config per size to fill one in.
CONFIGS: dict[str, tuple[tuple[float, GemmConfig], ...]] = {
    "default": (
        (4.0, GemmConfig(16, 32, 128, 64, 128, num_warps=4, num_stages=3)),
        (24.0, GemmConfig(32, 64, 64, 64, 64, num_warps=4, num_stages=3)),
        (float("inf"), GemmConfig(64, 128, 64, 128, 64, num_warps=8, num_stages=3)),
    ),
}


def device_key(device: torch.device) -> str:
    """'sm90' style key of a CUDA device ('cpu' for the interpreter)."""
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


def pick_config(R: int, E: int, device: torch.device) -> GemmConfig:
    """The table's config for R routes over E experts on ``device`` (the default table when untuned)."""
    table = CONFIGS.get(device_key(device), CONFIGS["default"])
    per_expert = R / max(E, 1)
    return next(cfg for limit, cfg in table if per_expert <= limit)


def all_configs(device: torch.device) -> list[GemmConfig]:
    """Every config the table can pick on ``device`` (what a warm-up compiles)."""
    return [cfg for _, cfg in CONFIGS.get(device_key(device), CONFIGS["default"])]


# -- expert kernels -----------------------------------------------------------------------------------------
@triton.jit
def _load_w(w_ptr, offs_n, offs_k, mask_n, mask_k, stride_wn, FP8: tl.constexpr, CDT: tl.constexpr):
    """A [BK, BN] weight tile (rows offs_n of one expert, transposed for the dot) in the compute dtype. The
    one place that decodes a weight format (fp8 codes are exact in bf16)."""
    w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                other=0.0)
    if FP8:
        w = w.to(tl.float32)
    return w.to(CDT)


@triton.jit
def _load_mx(w_ptr, s_ptr, offs_n, offs_kb, k0, mask_n, mask_kb, KB, stride_wn, stride_sn, CDT: tl.constexpr,
             BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """MXFP4: the [BK/2, BN] bytes of rows offs_n at byte columns offs_kb (= k0/2 + j; KB bytes a row) ->
    (even, odd) weight tiles [BK/2, BN] in the compute dtype: elements k0 + 2j and k0 + 2j + 1, times their
    block's scale (exact: e2m1 has 2 significant bits)."""
    m = mask_kb[:, None] & mask_n[None, :]
    b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_kb[:, None], mask=m, other=0)
    lo, hi = _e2m1(b)  # [BK/2, BN] fp32, 2**-14 times the values
    offs_sb = k0 // 32 + tl.arange(0, BLOCK_K // 32)  # [BK/32] scale blocks of this k-step
    s = tl.load(s_ptr + offs_n[None, :] * stride_sn + offs_sb[:, None],
                mask=(offs_sb[:, None] < KB // 16) & mask_n[None, :], other=0)
    scale = tl.reshape(tl.broadcast_to(_e8m0_scale(s)[:, None, :], [BLOCK_K // 32, 16, BLOCK_N]),
                       [BLOCK_K // 2, BLOCK_N])  # each block's scale on its 16 bytes
    return (lo * scale).to(CDT), (hi * scale).to(CDT)


@triton.jit
def _load_s(s_ptr, offs_n, mask_n, s_row0, stride_sn, k0, SB: tl.constexpr):
    """fp8: the block scale [BN] of rows offs_n at k-step k0 (BLOCK_K divides 128: one per row)."""
    return tl.load(s_ptr + (s_row0 + offs_n // SB) * stride_sn + k0 // SB, mask=mask_n, other=0.0)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b in fp32 (fp32 operands: no tf32 rounding)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit(do_not_specialize=["R"])
def _gate_up_kernel(
    x_ptr, routes_ptr, tiles_ptr, w_ptr, s_ptr, b_ptr, act_ptr,
    R, A, D, I, NB,  # NB = ceil(I/128): up's first scale row
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_act,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr, IEEE: tl.constexpr,
    MX: tl.constexpr, GQ: tl.constexpr,  # GQ: the GGUF type code of the bank (gguf_dequant), 0 = not GGUF
):
    m = tl.program_id(0)
    e = tl.load(tiles_ptr + m)
    if e >= 0:
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] padded rows of this tile
        route = tl.load(routes_ptr + rows)
        valid = route < R
        tok = tl.where(valid, route // A, 0)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] rows of gate (and of up)
        mask_n = offs_n < I
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        CDT = x_ptr.dtype.element_ty
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, D, BLOCK_K):
            if MX:  # D/2 bytes per row: x's even and odd columns meet the bytes' low and high nibbles
                offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                mask_kb = offs_kb < D // 2
                xm = valid[:, None] & mask_kb[None, :]
                xe = tl.load(x_ptr + tok[:, None] * stride_x + 2 * offs_kb[None, :], mask=xm, other=0.0)  # [BM, BK/2]
                xo = tl.load(x_ptr + tok[:, None] * stride_x + 2 * offs_kb[None, :] + 1, mask=xm, other=0.0)
                we, wo = _load_mx(w_base, s_base, offs_n, offs_kb, k0, mask_n, mask_kb, D // 2, stride_wn, stride_sn,
                                  CDT, BLOCK_K, BLOCK_N)
                g = _dot(xe, we, IEEE) + _dot(xo, wo, IEEE)
                we, wo = _load_mx(w_base + I * stride_wn, s_base + I * stride_sn, offs_n, offs_kb, k0, mask_n,
                                  mask_kb, D // 2, stride_wn, stride_sn, CDT, BLOCK_K, BLOCK_N)
                u = _dot(xe, we, IEEE) + _dot(xo, wo, IEEE)
            elif GQ >= 1 and GQ <= 3 and BLOCK_K % 64 == 0:  # K-quants: 64-value groups (gguf_group_dot)
                g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                w_rows = w_base + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN] row pointers
                for gg in tl.static_range(BLOCK_K // 64):
                    kg = k0 + gg * 64
                    if kg < D:  # a branch, not a mask: the interpreter widens `mask & scalar` to int32
                        x_ptrs = x_ptr + tok[:, None] * stride_x + kg  # [BM, 1]
                        g += gguf_group_dot(x_ptrs, valid[:, None], w_rows, kg, mask_n[None, :], GQ, CDT, IEEE,
                                            BLOCK_N)
                        u += gguf_group_dot(x_ptrs, valid[:, None], w_rows + I * stride_wn, kg, mask_n[None, :], GQ,
                                            CDT, IEEE, BLOCK_N)
            elif GQ != 0:  # other GGUF types: [BK, BN] tiles of gate's rows and up's, decoded per value
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < D
                x = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)  # [BM, BK]
                w_rows = w_base + offs_n[None, :].to(tl.int64) * stride_wn  # [1, BN] row pointers
                wm = mask_k[:, None] & mask_n[None, :]
                g = _dot(x, gguf_values(w_rows, offs_k[:, None], wm, GQ).to(CDT), IEEE)
                u = _dot(x, gguf_values(w_rows + I * stride_wn, offs_k[:, None], wm, GQ).to(CDT), IEEE)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < D
                x = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=valid[:, None] & mask_k[None, :],
                            other=0.0)  # [BM, BK]
                g = _dot(x, _load_w(w_base, offs_n, offs_k, mask_n, mask_k, stride_wn, FP8, CDT), IEEE)
                u = _dot(x, _load_w(w_base + I * stride_wn, offs_n, offs_k, mask_n, mask_k, stride_wn, FP8, CDT), IEEE)
                if FP8:  # the block's partial products times their rows' scales (gate's grid, then up's from NB)
                    g *= _load_s(s_base, offs_n, mask_n, 0, stride_sn, k0, SB)[None, :]
                    u *= _load_s(s_base, offs_n, mask_n, NB, stride_sn, k0, SB)[None, :]
            acc_g += g
            acc_u += u
        if HAS_BIAS:
            b_base = b_ptr + e.to(tl.int64) * stride_be
            acc_g += tl.load(b_base + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(b_base + I + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if CLAMPED:  # gpt-oss: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
            g = tl.minimum(acc_g, LIMIT)
            u = tl.minimum(tl.maximum(acc_u, -LIMIT), LIMIT)
            act = (u + 1.0) * (g / (1.0 + tl.exp(-ALPHA * g)))
        else:  # silu(gate) * up
            act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
        tl.store(act_ptr + rows[:, None] * stride_act + offs_n[None, :], act.to(CDT), mask=mask_n[None, :])


@triton.jit(do_not_specialize=["R"])
def _down_kernel(
    act_ptr, routes_ptr, tiles_ptr, w_ptr, s_ptr, b_ptr, rw_ptr, y_ptr,
    R, D, I,
    stride_act, stride_we, stride_wn, stride_se, stride_sn, stride_be, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, MX: tl.constexpr, GQ: tl.constexpr,
):
    m = tl.program_id(0)
    e = tl.load(tiles_ptr + m)
    if e >= 0:
        rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
        route = tl.load(routes_ptr + rows)
        valid = route < R
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows (of D)
        mask_n = offs_n < D
        w_base = w_ptr + e.to(tl.int64) * stride_we
        s_base = s_ptr + e.to(tl.int64) * stride_se
        CDT = act_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            if MX:  # I/2 bytes per row
                offs_kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                mask_kb = offs_kb < I // 2
                a_ptrs = act_ptr + rows[:, None] * stride_act + 2 * offs_kb[None, :]
                ae = tl.load(a_ptrs, mask=mask_kb[None, :], other=0.0)  # [BM, BK/2]
                ao = tl.load(a_ptrs + 1, mask=mask_kb[None, :], other=0.0)
                we, wo = _load_mx(w_base, s_base, offs_n, offs_kb, k0, mask_n, mask_kb, I // 2, stride_wn, stride_sn,
                                  CDT, BLOCK_K, BLOCK_N)
                part = _dot(ae, we, IEEE) + _dot(ao, wo, IEEE)
            elif GQ >= 1 and GQ <= 3 and BLOCK_K % 64 == 0:  # K-quant rows of I values: 64-value groups
                part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                w_rows = w_base + offs_n[None, :].to(tl.int64) * stride_wn
                for gg in tl.static_range(BLOCK_K // 64):
                    kg = k0 + gg * 64
                    if kg < I:  # a branch, not a mask (as above); act_buf has every padded row
                        part += gguf_group_dot(act_ptr + rows[:, None] * stride_act + kg, rows[:, None] >= 0, w_rows,
                                               kg, mask_n[None, :], GQ, CDT, IEEE, BLOCK_N)
            elif GQ != 0:  # other GGUF rows of I values, decoded per value
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < I
                a = tl.load(act_ptr + rows[:, None] * stride_act + offs_k[None, :], mask=mask_k[None, :], other=0.0)
                w = gguf_values(w_base + offs_n[None, :].to(tl.int64) * stride_wn, offs_k[:, None],
                                mask_k[:, None] & mask_n[None, :], GQ)
                part = _dot(a, w.to(CDT), IEEE)
            else:
                offs_k = k0 + tl.arange(0, BLOCK_K)
                mask_k = offs_k < I
                a = tl.load(act_ptr + rows[:, None] * stride_act + offs_k[None, :], mask=mask_k[None, :], other=0.0)
                part = _dot(a, _load_w(w_base, offs_n, offs_k, mask_n, mask_k, stride_wn, FP8, CDT), IEEE)
                if FP8:
                    part *= _load_s(s_base, offs_n, mask_n, 0, stride_sn, k0, SB)[None, :]
            acc += part
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        rw = tl.load(rw_ptr + route, mask=valid, other=0.0).to(tl.float32)  # [BM] routing weights
        safe = tl.where(valid, route, 0).to(tl.int64)
        tl.store(y_ptr + safe[:, None] * stride_y + offs_n[None, :], acc * rw[:, None],
                 mask=valid[:, None] & mask_n[None, :])


@triton.jit
def _combine_kernel(y_ptr, ids_ptr, out_ptr, A, D, stride_y, stride_out, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for a in range(0, A):  # in route order, like the reference; skipped routes have no row of y
        e = tl.load(ids_ptr + t * A + a)
        if e >= 0:  # a branch, not `mask & (e >= 0)`: triton 3.9's interpreter widens that mask to int32
            acc += tl.load(y_ptr + (t * A + a) * stride_y + offs, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_out + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _check(hidden, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale, bias, gguf_types):
    T, A = topk_ids.shape
    mx = gate_up.dtype == torch.uint8  # MXFP4: half a byte per weight
    E, two_i = gate_up.shape[:2]
    I = two_i // 2
    D = gate_up.shape[2] * (2 if mx else 1)
    gq = (0, 0)
    if mx and gate_up_scale is None and gguf_types is None:  # never guessed from the shape: rows may be padded
        raise ValueError("moe_gemm: uint8 banks without scales are GGUF banks: pass gguf_types (MXFP4 banks: "
                         "their gate_up_scale / down_scale)")
    if gguf_types is not None:  # GGUF blocks: D from hidden, each bank's type named
        D, I, *gq = gguf_geometry("moe_gemm", hidden, gate_up, down, gguf_types)
        mx = False
    if hidden.shape != (T, D) or topk_weights.shape != (T, A) or (not any(gq) and tuple(down.shape) != (
            E, D, I // 2 if mx else I)):
        raise ValueError(f"moe_gemm: shapes hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} do not match [T, D], [T, A], [T, A], [E, 2I, D], [E, D, I]")
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("moe_gemm: gate_up and down need a contiguous last dimension")
    nb, nd = triton.cdiv(I, SCALE_BLOCK), triton.cdiv(D, SCALE_BLOCK)
    if mx:
        if (D % MX_BLOCK or I % MX_BLOCK or gate_up_scale is None or down_scale is None
                or tuple(gate_up_scale.shape) != (E, two_i, D // MX_BLOCK)
                or tuple(down_scale.shape) != (E, D, I // MX_BLOCK)
                or gate_up_scale.stride(2) != 1 or down_scale.stride(2) != 1):
            raise ValueError(f"moe_gemm: MXFP4 banks need D ({D}) and I ({I}) multiples of {MX_BLOCK} and scales "
                             f"[E, 2I, D/32] = {(E, two_i, D // MX_BLOCK)}, [E, D, I/32] = {(E, D, I // MX_BLOCK)}")
    elif gate_up_scale is not None and (down_scale is None or gate_up_scale.shape != (E, 2 * nb, nd)
                                      or down_scale.shape != (E, nd, nb) or gate_up_scale.stride(2) != 1
                                      or down_scale.stride(2) != 1) and not any(gq):
        raise ValueError(f"moe_gemm: fp8 scales gate_up_scale {tuple(gate_up_scale.shape)}, down_scale "
                         f"{None if down_scale is None else tuple(down_scale.shape)} do not match "
                         f"[E, 2*ceil(I/128), ceil(D/128)] = {(E, 2 * nb, nd)} and [E, ceil(D/128), ceil(I/128)]")
    if bias is not None and (bias[0].shape != (E, two_i) or bias[1].shape != (E, D)):
        raise ValueError(f"moe_gemm: biases {tuple(bias[0].shape)}, {tuple(bias[1].shape)} do not match "
                         f"[E, 2I] = {(E, two_i)} and [E, D] = {(E, D)}")
    return T, A, E, D, I, nb, tuple(gq)


def moe_gemm(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, act=None, bias: tuple[torch.Tensor, torch.Tensor] | None = None,
             gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
             config: GemmConfig | None = None, gguf_types=None) -> torch.Tensor:
    """hidden [T, D] · topk_ids [T, A] int (-1 = skip) · topk_weights [T, A] · gate_up [E, 2I, D] ·
    down [E, D, I] · act: None (silu(gate) * up) or a ClampedSwiGLU · bias: (gate_up_bias [E, 2I],
    down_bias [E, D]) or None · FP8 banks: gate_up_scale [E, 2*ceil(I/128), ceil(D/128)] and down_scale
    [E, ceil(D/128), ceil(I/128)] fp32 · MXFP4 banks (told apart by their uint8 weights): gate_up [E, 2I, D/2],
    down [E, D, I/2], gate_up_scale [E, 2I, D/32], down_scale [E, D, I/32] uint8 · GGUF banks: ``gguf_types``
    = (gate_up's, down's) GGUFType or value (e.g. ("q4_K", "q6_K")), no scales, gate_up [E, 2I, >= row_bytes(D)]
    and down [E, D, >= row_bytes(I)] uint8 (services/engine/moe/gguf_quant.py) · config: a GemmConfig, default
    from the table -> [T, D] in hidden's dtype (fp32 accumulation). Same contract as moe_reference."""
    T, A, E, D, I, nb, (gq, dq) = _check(hidden, topk_ids, topk_weights, gate_up, down, gate_up_scale, down_scale,
                                         bias, gguf_types)
    mx = gate_up.dtype == torch.uint8 and not gq
    fp8 = gate_up_scale is not None and not mx
    R = T * A
    cfg = config or pick_config(R, E, hidden.device)
    if fp8 and (SCALE_BLOCK % cfg.block_k or SCALE_BLOCK % cfg.block_k2):
        raise ValueError(f"moe_gemm: fp8 needs block_k and block_k2 dividing {SCALE_BLOCK}, got {cfg}")
    if mx and (cfg.block_k % MX_BLOCK or cfg.block_k2 % MX_BLOCK):
        raise ValueError(f"moe_gemm: MXFP4 needs block_k and block_k2 multiples of {MX_BLOCK}, got {cfg}")
    dev = hidden.device
    hidden = hidden.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [R]
    routes, tile_expert = align_routes(ids, E, cfg.block_m)
    NT = tile_expert.numel()
    gs, ds = (gate_up_scale, down_scale) if fp8 or mx else (gate_up, down)  # not read unless FP8 / MXFP4
    bg, bd = bias if bias is not None else (gate_up, down)  # not read without biases
    ieee = hidden.dtype == torch.float32
    act_buf = torch.empty((NT * cfg.block_m, I), dtype=hidden.dtype, device=dev)  # [M, I] padded rows
    y = torch.empty((R, D), dtype=torch.float32, device=dev)  # [R, D] by route (skipped rows not written)
    _gate_up_kernel[(NT, triton.cdiv(I, cfg.block_n))](
        hidden, routes, tile_expert, gate_up, gs, bg, act_buf,
        R, A, D, I, nb,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), gs.stride(0), gs.stride(1), bg.stride(0),
        act_buf.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=fp8, SB=SCALE_BLOCK,
        HAS_BIAS=bias is not None, CLAMPED=act is not None, ALPHA=float(getattr(act, "alpha", 1.0)),
        LIMIT=float(getattr(act, "limit", 0.0)), IEEE=ieee, MX=mx, GQ=gq, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    weights = topk_weights.reshape(-1).contiguous()  # [R]
    _down_kernel[(NT, triton.cdiv(D, cfg.block_n2))](
        act_buf, routes, tile_expert, down, ds, bd, weights, y,
        R, D, I,
        act_buf.stride(0), down.stride(0), down.stride(1), ds.stride(0), ds.stride(1), bd.stride(0), y.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n2, BLOCK_K=cfg.block_k2, FP8=fp8, SB=SCALE_BLOCK,
        HAS_BIAS=bias is not None, IEEE=ieee, MX=mx, GQ=dq, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    out = torch.empty((T, D), dtype=hidden.dtype, device=dev)  # [T, D]
    _combine_kernel[(T, triton.cdiv(D, 256))](y, ids, out, A, D, y.stride(0), out.stride(0), BLOCK=256)
    return out


def moe_gemm_torch(hidden, topk_ids, topk_weights, gate_up, down, act=None, bias=None, gate_up_scale=None,
                   down_scale=None, block_m: int = 16) -> torch.Tensor:
    """The same tile algorithm in torch, from ``align_routes``'s output (the kernels' reference for the
    alignment: every tile's rows multiplied by its expert, padding rows dropped). Host loops: tests only."""
    from services.engine.moe.fp8 import dense_experts
    from services.engine.moe.reference import expert_swiglu

    T, A = topk_ids.shape
    R = T * A
    routes, tile_expert = align_routes(topk_ids.reshape(-1), gate_up.shape[0], block_m)
    y = torch.zeros((R, hidden.shape[1]), dtype=torch.float32, device=hidden.device)
    for m, e in enumerate(tile_expert.tolist()):
        if e < 0:
            continue
        r = routes[m * block_m:(m + 1) * block_m].long()
        r = r[r < R]
        gu, d = dense_experts(gate_up[e], down[e], None if gate_up_scale is None else gate_up_scale[e],
                              None if down_scale is None else down_scale[e], torch.float32)
        b_gu, b_d = (bias[0][e].float(), bias[1][e].float()) if bias is not None else (None, None)
        out = expert_swiglu(hidden[r // A].float(), gu, d, act, b_gu, b_d)
        y[r] = out * topk_weights.reshape(-1)[r, None].float()
    return y.view(T, A, -1).sum(dim=1).to(hidden.dtype)

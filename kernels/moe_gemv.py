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
The reference is ``services.engine.moe.reference.moe_reference``; tests/kernels/test_moe_gemv.py.

FP8 experts (fp8_block banks, services/engine/moe/fp8.py): the same kernels read float8_e4m3fn weights
and multiply each element by its 128x128 block's fp32 scale in registers (a scale load per element
hits L1: a [16, 256] tile touches at most 2 x 3 scales), so no dequantized copy of an expert exists;
the reference is fp8.dequantize + moe_reference (tests/kernels/test_moe_gemv_fp8.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Kernel 1 programs: (route, BLOCK_I rows of gate and of up). Qwen3-30B-A3B (I=768, D=2048), R=8:
# 384 programs of 128 KiB of bf16 weights each — enough in flight to stream HBM on 132 SMs.
BLOCK_I, BLOCK_K1 = 16, 256
# Kernel 2 programs: (route, BLOCK_D output rows), each reading BLOCK_D x I weights.
BLOCK_D, BLOCK_K2 = 32, 256
# Combine programs: (token, BLOCK_C outputs), each summing A fp32 rows (tiny: T*A*D*4 bytes in all).
BLOCK_C = 256


SCALE_BLOCK = 128  # fp8_block: the edge of a scale's block (fp8.BLOCK)


@triton.jit
def _gate_up_act_kernel(
    # pointers (gs_ptr: fp8 scales [E, 2*ceil(I/128), ceil(D/128)], unused unless FP8)
    x_ptr, ids_ptr, gate_up_ptr, act_ptr, gs_ptr,
    # sizes (NB = ceil(I/128): the first scale row of up)
    A, D, I, NB,
    # strides (elements)
    stride_x, stride_ge, stride_gr, stride_act, stride_gse, stride_gsr,
    # meta
    BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
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
        for k0 in range(0, D, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < D
            x = tl.load(x_ptr + t * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)  # [BLOCK_K]
            m = mask_i[:, None] & mask_k[None, :]
            wg = tl.load(base + offs_i[:, None] * stride_gr + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
            wu = tl.load(base + (offs_i[:, None] + I) * stride_gr + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
            if FP8:  # gate's block rows, then up's from NB on
                sbase = gs_ptr + e.to(tl.int64) * stride_gse + (offs_k // SB)[None, :]
                wg *= tl.load(sbase + (offs_i // SB)[:, None] * stride_gsr, mask=m, other=0.0)
                wu *= tl.load(sbase + (NB + offs_i // SB)[:, None] * stride_gsr, mask=m, other=0.0)
            acc_g += tl.sum(wg * x[None, :], axis=1)
            acc_u += tl.sum(wu * x[None, :], axis=1)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u  # silu(g) * u; zeros for skipped routes
    tl.store(act_ptr + r * stride_act + offs_i, act, mask=mask_i)


@triton.jit
def _down_kernel(
    # pointers (ds_ptr: fp8 scales [E, ceil(D/128), ceil(I/128)], unused unless FP8)
    act_ptr, ids_ptr, w_ptr, down_ptr, y_ptr, ds_ptr,
    # sizes
    D, I,
    # strides (elements)
    stride_act, stride_de, stride_dr, stride_y, stride_dse, stride_dsr,
    # meta
    BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, SB: tl.constexpr,
):
    r = tl.program_id(0)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D] output rows
    mask_d = offs_d < D
    e = tl.load(ids_ptr + r)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if e >= 0:
        base = down_ptr + e.to(tl.int64) * stride_de
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < I
            a = tl.load(act_ptr + r * stride_act + offs_k, mask=mask_k, other=0.0)  # [BLOCK_K] fp32
            m = mask_d[:, None] & mask_k[None, :]
            wd = tl.load(base + offs_d[:, None] * stride_dr + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
            if FP8:
                wd *= tl.load(ds_ptr + e.to(tl.int64) * stride_dse + (offs_d // SB)[:, None] * stride_dsr
                              + (offs_k // SB)[None, :], mask=m, other=0.0)
            acc += tl.sum(wd * a[None, :], axis=1)
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


def moe_gemv(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None = None,
             down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, D] · topk_ids [T, A] int (-1 = skip) · topk_weights [T, A] · gate_up [E, 2I, D] ·
    down [E, D, I] -> [T, D] in hidden's dtype (fp32 accumulation). Same contract as moe_reference.
    FP8 banks: gate_up and down float8_e4m3fn with gate_up_scale [E, 2*ceil(I/128), ceil(D/128)] and
    down_scale [E, ceil(D/128), ceil(I/128)] fp32 (services/engine/moe/fp8.py)."""
    T, A = topk_ids.shape
    E, two_i, D = gate_up.shape
    I = two_i // 2
    if hidden.shape != (T, D) or down.shape != (E, D, I) or topk_weights.shape != (T, A):
        raise ValueError(f"moe_gemv: shapes hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)}, "
                         f"topk_weights {tuple(topk_weights.shape)}, gate_up {tuple(gate_up.shape)}, "
                         f"down {tuple(down.shape)} do not match [T, D], [T, A], [T, A], [E, 2I, D], [E, D, I]")
    if gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("moe_gemv: gate_up and down need a contiguous last dimension")
    fp8 = gate_up_scale is not None
    nb, nd = -(-I // SCALE_BLOCK), -(-D // SCALE_BLOCK)
    if fp8 and (down_scale is None or gate_up_scale.shape != (E, 2 * nb, nd) or down_scale.shape != (E, nd, nb)
                or gate_up_scale.stride(2) != 1 or down_scale.stride(2) != 1):
        raise ValueError(f"moe_gemv: fp8 scales gate_up_scale {tuple(gate_up_scale.shape)}, down_scale "
                         f"{None if down_scale is None else tuple(down_scale.shape)} do not match "
                         f"[E, 2*ceil(I/128), ceil(D/128)] = {(E, 2 * nb, nd)} and [E, ceil(D/128), ceil(I/128)]")
    gs = gate_up_scale if fp8 else gate_up  # not read unless FP8
    ds = down_scale if fp8 else down
    hidden = hidden.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [R]
    weights = topk_weights.reshape(-1).contiguous()  # [R]
    R = ids.numel()
    act = torch.empty((R, I), dtype=torch.float32, device=hidden.device)  # [R, I]
    y = torch.empty((R, D), dtype=torch.float32, device=hidden.device)  # [R, D]
    _gate_up_act_kernel[(R, triton.cdiv(I, BLOCK_I))](
        hidden, ids, gate_up, act, gs,
        A, D, I, nb,
        hidden.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0), gs.stride(0), gs.stride(1),
        BLOCK_I=BLOCK_I, BLOCK_K=BLOCK_K1, FP8=fp8, SB=SCALE_BLOCK,
    )
    _down_kernel[(R, triton.cdiv(D, BLOCK_D))](
        act, ids, weights, down, y, ds,
        D, I,
        act.stride(0), down.stride(0), down.stride(1), y.stride(0), ds.stride(0), ds.stride(1),
        BLOCK_D=BLOCK_D, BLOCK_K=BLOCK_K2, FP8=fp8, SB=SCALE_BLOCK,
    )
    out = torch.empty((T, D), dtype=hidden.dtype, device=hidden.device)  # [T, D]
    _combine_kernel[(T, triton.cdiv(D, BLOCK_C))](  # sum over the A routes + cast: one launch, not two
        y, out, A, D, y.stride(0), out.stride(0), BLOCK=BLOCK_C,
    )
    return out

"""rms_norm / add_rms_norm: the decoder's RMSNorm (optionally fused with the residual add) in ONE launch.

Dimension legend: T tokens (rows) · N normalised size (D hidden).

Why: in torch an HF-exact RMSNorm is 8 kernels (cast, pow, mean, add, rsqrt, mul, cast, mul) and the
residual add one more; a bs=1 decode step runs 2 of them per layer, and under CUDA-graph replay each
kernel still costs a few us. One program per row does it all; the arithmetic and its roundings follow
``rms_norm_ref`` (transformers' order: fp32 statistics, normalised value rounded to the input dtype,
then multiplied by the weight in that dtype), so results equal torch's up to the fp32 sum order.

    residual' = x + residual                       (rounded to x's dtype, as a torch add)
    out       = weight * (r / sqrt(mean(r^2) + eps)).to(dtype)    with r = residual' in fp32

The reference is ``rms_norm_ref``; tests/kernels/test_rmsnorm.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    N, eps,
    stride_x, stride_res, stride_out, stride_res_out,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + t * stride_x + offs, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + t * stride_res + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # the torch add, rounded to the dtype
        tl.store(res_out_ptr + t * stride_res_out + offs, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / N
    n = (h * tl.rsqrt(var + eps)).to(dt)  # rounded as transformers' .to(input_dtype)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = (w.to(tl.float32) * n.to(tl.float32)).to(dt)  # weight * h in the dtype
    tl.store(out_ptr + t * stride_out + offs, out, mask=mask)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pure torch: x [T, N] (+ residual [T, N]) · weight [N] -> (out [T, N], x + residual or None)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), (x if residual is not None else None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, N] (+ residual [T, N], same dtype) · weight [N] -> (out [T, N], new residual [T, N] or None).
    Last dimension contiguous; rows may be strided. Same contract as ``rms_norm_ref``."""
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x {tuple(x.shape)} (stride {x.stride()}) and weight {tuple(weight.shape)} "
                         f"must be [T, N] with a contiguous last dim and [N]")
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: weight dtype {weight.dtype} differs from x dtype {x.dtype}")
    T, N = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if residual is not None:
        if residual.shape != x.shape or residual.stride(1) != 1 or residual.dtype != x.dtype:
            raise ValueError(f"rms_norm: residual {tuple(residual.shape)} {residual.dtype} does not match x")
        res_out = torch.empty_like(out)
    else:
        residual, res_out = x, out  # unused (HAS_RESIDUAL=False)
    _rms_norm_kernel[(T,)](
        x, residual, weight, out, res_out,
        N, eps,
        x.stride(0), residual.stride(0), out.stride(0), res_out.stride(0),
        HAS_RESIDUAL=res_out is not out, BLOCK_N=triton.next_power_of_2(N),
        num_warps=4 if N <= 4096 else 8,
    )
    return out, (res_out if res_out is not out else None)

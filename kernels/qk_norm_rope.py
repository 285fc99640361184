"""qk_norm_rope_: per-head RMSNorm (Qwen3's q_norm/k_norm, optional) + rotary embedding of q and k, in
place, in ONE launch.

Dimension legend: T tokens · H query heads · K kv heads · NH = H + K heads processed · Dh head dim.

Why: in torch the two per-head norms are 16 kernels and the two rotate-half ropes 10 more per layer; a
bs=1 decode step is launch-bound. One program per (token, head) loads the head's Dh values once,
normalises them and rotates them, with the roundings of the torch path (``qk_norm_rope_ref``):

    y   = w_head * (x / sqrt(mean(x^2) + eps)).to(dtype)        (only with HAS_NORM)
    out = y * cos + rotate_half(y) * sin     rotate_half(y) = cat(-y[Dh/2:], y[:Dh/2]); each op rounded

``qk`` is the q and k part of the fused qkv projection ([T, NH, Dh] view, head stride Dh, rows strided).
The reference is ``qk_norm_rope_ref``; tests/kernels/test_qk_norm_rope.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    qk_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
    H, HALF, eps,
    stride_t, stride_h, stride_cs,
    HAS_NORM: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    base = qk_ptr + t * stride_t + head * stride_h
    x1 = tl.load(base + offs, mask=mask, other=0.0)  # [BLOCK] first half of the head
    x2 = tl.load(base + HALF + offs, mask=mask, other=0.0)  # second half
    dt = x1.dtype
    if HAS_NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        var = (tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF)
        rs = tl.rsqrt(var + eps)
        if head < H:
            w1 = tl.load(qw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(qw_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            w1 = tl.load(kw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(kw_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (f1 * rs).to(dt).to(tl.float32)).to(dt)
        x2 = (w2 * (f2 * rs).to(dt).to(tl.float32)).to(dt)
    c1 = tl.load(cos_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + t * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + t * stride_cs + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + t * stride_cs + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    y1, y2 = x1.to(tl.float32), x2.to(tl.float32)
    # torch rounds each product and the sum to the dtype; so does this
    o1 = ((y1 * c1).to(dt).to(tl.float32) + (-y2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((y2 * c2).to(dt).to(tl.float32) + (y1 * s2).to(dt).to(tl.float32)).to(dt)
    tl.store(base + offs, o1, mask=mask)
    tl.store(base + HALF + offs, o2, mask=mask)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos[:, None, :] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None, :]


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def qk_norm_rope_ref(qk: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                     q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     eps: float = 1e-6) -> torch.Tensor:
    """Pure torch, in place: qk [T, NH, Dh] (heads < num_q_heads are q) · cos/sin [T, Dh] · q/k_weight
    [Dh] (None: no norm) -> qk."""
    q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
    if q_weight is not None:
        q, k = _norm(q, q_weight, eps), _norm(k, k_weight, eps)
    qk[:, :num_q_heads] = _rotate(q, cos, sin)
    qk[:, num_q_heads:] = _rotate(k, cos, sin)
    return qk


def qk_norm_rope_(qk: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                  eps: float = 1e-6) -> torch.Tensor:
    """In place, one launch: qk [T, NH, Dh] (last dim contiguous) · cos/sin [T, Dh] in qk's dtype ·
    q/k_weight [Dh] or None -> qk. Same contract as ``qk_norm_rope_ref``."""
    T, NH, Dh = qk.shape
    if qk.stride(2) != 1 or Dh % 2 or cos.shape != (T, Dh) or sin.shape != (T, Dh) or cos.stride() != sin.stride():
        raise ValueError(f"qk_norm_rope_: qk {tuple(qk.shape)} (stride {qk.stride()}), cos {tuple(cos.shape)}, "
                         f"sin {tuple(sin.shape)}: need [T, NH, Dh] with contiguous even Dh and [T, Dh] cos/sin")
    if cos.stride(1) != 1 or cos.dtype != qk.dtype or sin.dtype != qk.dtype:
        raise ValueError(f"qk_norm_rope_: cos/sin must be contiguous rows in qk's dtype {qk.dtype}")
    has_norm = q_weight is not None
    if has_norm and (q_weight.shape != (Dh,) or k_weight is None or k_weight.shape != (Dh,)):
        raise ValueError(f"qk_norm_rope_: q/k norm weights must both be [{Dh}]")
    if T == 0:
        return qk
    _qk_norm_rope_kernel[(T, NH)](
        qk, q_weight if has_norm else cos, k_weight if has_norm else cos, cos, sin,
        num_q_heads, Dh // 2, eps,
        qk.stride(0), qk.stride(1), cos.stride(0),
        HAS_NORM=has_norm, BLOCK=triton.next_power_of_2(Dh // 2), num_warps=1,
    )
    return qk

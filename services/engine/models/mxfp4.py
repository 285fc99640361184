"""MXFP4 (OCP microscaling FP4) as gpt-oss checkpoints store their experts on the Hub.

A weight matrix [R, C] is stored as
    ``*_blocks`` uint8 [R, C/32, 16]: 32 e2m1 values per block, two per byte — element 2j in the low
                                       nibble of byte j, element 2j+1 in the high nibble;
    ``*_scales`` uint8 [R, C/32]:     one E8M0 exponent per block, bias 127 (value = 2**(s - 127)).
An e2m1 nibble is sign (bit 3) + a 3-bit magnitude index into {0, .5, 1, 1.5, 2, 3, 4, 6}.

The engine keeps these bytes as they are in its ``mxfp4`` expert banks (services/engine/moe/banks.py):
per row the blocks flattened to ``[R, C/2]`` bytes and the scales ``[R, C/32]``. ``dequantize`` here
is what transformers' ``convert_moe_packed_tensors`` computes (same table, same nibble order, same
exponent bias; every product is exact in bf16 and fp32): the pure-torch reference of every MXFP4
kernel (torch compute paths, the C++ CPU executor, Triton), and the ``--moe-expert-dtype dtype`` path.
"""

from __future__ import annotations

import torch

BLOCK = 32  # values per scale
SCALE_BIAS = 127  # E8M0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MIDPOINTS = tuple((a + b) / 2 for a, b in zip(E2M1_VALUES[:7], E2M1_VALUES[1:8]))  # between magnitudes


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """blocks uint8 [..., G, 16] · scales uint8 [..., G] -> [..., G*32] in ``dtype`` (rows as stored:
    no transpose, unlike transformers, whose parameters are [in, out])."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4: blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         f"(expected blocks [..., G, {BLOCK // 2}] and scales [..., G])")
    if scales.shape[-1] == 0:
        return torch.empty((*blocks.shape[:-2], 0), dtype=dtype, device=blocks.device)
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    out = torch.empty((*blocks.shape[:-1], BLOCK), dtype=torch.float32, device=blocks.device)  # [..., G, 32]
    out[..., 0::2] = lut[(blocks & 0x0F).long()]
    out[..., 1::2] = lut[(blocks >> 4).long()]
    exp = scales.to(torch.int32) - SCALE_BIAS  # [..., G]
    out = torch.ldexp(out, exp[..., None].float())
    return out.reshape(*blocks.shape[:-2], -1).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., C] (C a multiple of 32) -> (blocks uint8 [..., C/32, 16], scales uint8 [..., C/32]): per
    block the smallest power-of-two scale with max|w|/scale <= 6, values rounded to the nearest e2m1.
    For writing test and synthetic checkpoints in the Hub's layout; ``dequantize`` inverts it exactly
    on its own output."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: the last dimension ({w.shape[-1]}) must be a multiple of {BLOCK}")
    x = w.float().reshape(*w.shape[:-1], -1, BLOCK)  # [..., G, 32]
    amax = x.abs().amax(dim=-1)  # [..., G]
    exp = torch.ceil(torch.log2(torch.where(amax > 0, amax / 6.0, torch.ones_like(amax))))
    exp = exp.clamp(-SCALE_BIAS, 255 - SCALE_BIAS)
    q = x / torch.exp2(exp)[..., None]  # [..., G, 32], |q| <= 6
    # nearest magnitude, a tie to the smaller one: the index of the first midpoint >= |q| (no [..., 8]
    # temporary: the synthetic gpt-oss-120b quantizes 115 G values through this)
    mids = torch.tensor(_MIDPOINTS, device=w.device)
    idx = torch.bucketize(q.abs().contiguous(), mids, out_int32=True)  # [..., G, 32] in 0..7
    nibble = (idx | torch.where(q < 0, 8, 0)).to(torch.uint8)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return blocks.contiguous(), (exp + SCALE_BIAS).to(torch.uint8)


# ------------------------------------------------------------------------------------------------------
# The bank layout (services/engine/moe/banks.py, format mxfp4): a matrix [R, C] as packed [R, C/2] and
# scales [R, C/32], i.e. the Hub's blocks with their last two dimensions flattened (a view, no copy).


def dequantize_rows(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """packed uint8 [..., R, C/2] · scales uint8 [..., R, C/32] -> [..., R, C] in ``dtype``."""
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * (BLOCK // 2):
        raise ValueError(f"mxfp4: packed rows {list(packed.shape)} do not match scales {list(scales.shape)} "
                         f"(expected packed [..., R, C/2] and scales [..., R, C/{BLOCK}])")
    return dequantize(packed.unflatten(-1, (scales.shape[-1], BLOCK // 2)), scales, dtype)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., R, C] -> (packed uint8 [..., R, C/2], scales uint8 [..., R, C/32]) (``quantize``'s rounding)."""
    blocks, scales = quantize(w)
    return blocks.flatten(-2), scales


def dense_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor, down_scale: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """mxfp4 banks (one expert or a stack) -> (gate_up [..., 2I, D], down [..., D, I]) in ``dtype``."""
    return dequantize_rows(gate_up, gate_up_scale, dtype), dequantize_rows(down, down_scale, dtype)

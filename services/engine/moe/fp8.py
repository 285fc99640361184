"""Fine-grained FP8 weights: float8_e4m3fn values with one fp32 scale per 128x128 block.

The layout of Hugging Face / DeepSeek-V3 "fp8" checkpoints (``quantization_config.weight_block_size``
[128, 128]): a weight ``W [N, K]`` is stored as ``q [N, K]`` float8_e4m3fn and ``weight_scale_inv
[ceil(N/128), ceil(K/128)]`` with ``W[n, k] = q[n, k] * scale_inv[n // 128, k // 128]``. The grid is a
ceil grid: where N or K is not a multiple of 128 the last block row/column is partial (as DeepSeek-V3's
``weight_dequant``, vLLM and transformers' GPU path read it).

In the expert banks (services/engine/moe/banks.py, format ``fp8_block``) ``gate_up [E, 2I, D]`` stacks
gate_proj's rows on up_proj's, each quantized on its own grid, so ``gate_up_scale [E, 2*ceil(I/128),
ceil(D/128)]`` holds gate's block rows, then up's: row ``r`` of gate_up reads scale row ``r // 128`` for
``r < I`` and ``ceil(I/128) + (r - I) // 128`` after. When I is a multiple of 128 that is simply
``r // 128``.

This module is the pure-torch reference every FP8 kernel (Triton, C++) is tested against.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
from tqdm import tqdm

from services.common.logging import get_logger
from services.engine.moe.banks import BANK_SCHEMAS, ExpertFormat, host_bank

log = get_logger("moe.fp8")

BLOCK = 128  # the only block size the kernels take (the checkpoints in the wild all use [128, 128])
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value


def grid(n: int) -> int:
    """Blocks along a dimension of ``n`` elements (the last one partial when BLOCK does not divide n)."""
    return math.ceil(n / BLOCK)


def _expand(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """scale [..., ceil(rows/B), ceil(cols/B)] -> [..., rows, cols] (each block's scale on its elements)."""
    return scale.repeat_interleave(BLOCK, dim=-2)[..., :rows, :].repeat_interleave(BLOCK, dim=-1)[..., :cols]


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., N, K] fp8 · scale [..., ceil(N/128), ceil(K/128)] -> [..., N, K] in ``dtype`` (products in
    fp32, rounded once)."""
    N, K = q.shape[-2:]
    if tuple(scale.shape[-2:]) != (grid(N), grid(K)):
        raise ValueError(f"fp8 scale of shape {list(scale.shape)} does not fit a weight of shape {list(q.shape)} "
                         f"(expected [..., {grid(N)}, {grid(K)}] for {BLOCK}x{BLOCK} blocks)")
    return (q.float() * _expand(scale.float(), N, K)).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (q [..., N, K] fp8 e4m3fn, scale_inv [..., ceil(N/128), ceil(K/128)] fp32) with
    ``dequantize(q, scale_inv) ~= w``: each block's largest magnitude maps to 448 (round to nearest)."""
    N, K = w.shape[-2:]
    gn, gk = grid(N), grid(K)
    padded = torch.zeros((*w.shape[:-2], gn * BLOCK, gk * BLOCK), dtype=torch.float32, device=w.device)
    padded[..., :N, :K] = w.float()
    blocks = padded.unflatten(-2, (gn, BLOCK)).unflatten(-1, (gk, BLOCK))  # [..., gn, B, gk, B]
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., gn, gk]
    scale = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)  # an all-zero block keeps scale > 0
    q = (w.float() / _expand(scale, N, K)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def gate_up_scale_rows(I: int) -> tuple[int, int]:
    """(first scale row of gate, first scale row of up) in a gate_up scale bank of an intermediate I."""
    return 0, grid(I)


def dequantize_gate_up(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [..., 2I, D] · scale [..., 2*ceil(I/128), ceil(D/128)] (gate's grid, then up's) -> [..., 2I, D]."""
    I, nb = q.shape[-2] // 2, grid(q.shape[-2] // 2)
    return torch.cat([dequantize(q[..., :I, :], scale[..., :nb, :], dtype),
                      dequantize(q[..., I:, :], scale[..., nb:, :], dtype)], dim=-2)


def quantize_gate_up(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., 2I, D] -> (q [..., 2I, D], scale [..., 2*ceil(I/128), ceil(D/128)]): gate and up apart."""
    I = w.shape[-2] // 2
    (qg, sg), (qu, su) = quantize(w[..., :I, :]), quantize(w[..., I:, :])
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def dense_experts(gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
                  down_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert weights in ``dtype`` whatever the bank format: FP8 banks (scales given) dequantized, others
    cast. Works on one expert ([2I, D], [D, I]) or a stack ([n, 2I, D], [n, D, I])."""
    if gate_up_scale is None:
        return gate_up.to(dtype), down.to(dtype)
    if gate_up.dtype != FP8_DTYPE or gate_up_scale.dtype != torch.float32:  # e.g. mxfp4's uint8 + E8M0 bytes
        raise ValueError(f"fp8 experts are float8_e4m3fn with fp32 block scales, got {gate_up.dtype} with "
                         f"{gate_up_scale.dtype} scales (other formats: services/engine/moe/dequant.py)")
    return dequantize_gate_up(gate_up, gate_up_scale, dtype), dequantize(down, down_scale, dtype)


Progress = Callable[[dict], None]
QUANTIZE_CHUNK = 16  # experts quantized together: ~0.3 GB of fp32 temporaries at Qwen3-30B-A3B's width


def quantize_layers(layers, progress: Progress | None = None, work_device: torch.device | None = None) -> None:
    """Online ``--moe-expert-dtype fp8``: turn every unquantized LayerBanks of ``layers`` into fp8_block in
    place, one layer at a time (the layer's bf16/fp32 banks are freed as soon as its FP8 banks exist, so
    the peak is one extra layer). ``work_device``: where the arithmetic runs (a GPU: chunks go there and
    back, ~1 s for Qwen3-30B-A3B's 58 GB instead of a minute of CPU); None = where the banks are.
    ``progress`` gets ``{"phase": "quantizing", "done", "total", "fraction"}`` after each layer; a tqdm
    bar shows the same on stderr."""
    t0 = time.perf_counter()
    total = len(layers)
    with tqdm(total=total, desc="quantizing experts to fp8", unit="layer", leave=False) as bar:
        for done, layer in enumerate(layers, 1):
            gate_up, down = layer.tensors["gate_up"], layer.tensors["down"]
            E, two_i, D = gate_up.shape
            fresh = {}
            for spec in BANK_SCHEMAS[ExpertFormat.FP8_BLOCK]:
                shape = (E, *spec.shape(D, two_i // 2))
                fresh[spec.name] = (host_bank(shape, spec.dtype) if gate_up.device.type == "cpu"
                                    else torch.empty(shape, dtype=spec.dtype, device=gate_up.device))
            for e in range(0, E, QUANTIZE_CHUNK):  # fp32 temporaries of a chunk, not of the whole layer
                c = slice(e, e + QUANTIZE_CHUNK)
                work = work_device or gate_up.device
                for (q_name, s_name), fn, src in ((("gate_up", "gate_up_scale"), quantize_gate_up, gate_up),
                                                  (("down", "down_scale"), quantize, down)):
                    q, scale = fn(src[c].to(work, non_blocking=True))
                    fresh[q_name][c].copy_(q)
                    fresh[s_name][c].copy_(scale)
            layer.format, layer.tensors = ExpertFormat.FP8_BLOCK, fresh
            bar.update(1)
            if progress is not None:
                progress({"phase": "quantizing", "done": done, "total": total, "fraction": done / total})
    log.info("experts quantized to fp8 (128x128 blocks): %d layers in %.1f s", total, time.perf_counter() - t0)

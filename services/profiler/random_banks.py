"""Random MXFP4 expert banks, fast: what `tandem bench bw --dtype mxfp4` and benchmarks/bench_cpu_executor
measure on (bank names and shapes: services/engine/moe/banks.py, ExpertFormat.MXFP4).

The banks are filled by tiling a small pool of random bytes: torch's CPU RNG is serial (~0.2 GB/s on the
H200 host), so drawing gpt-oss-120b's 4 layers x 128 experts (6.7 GB of nibbles) byte by byte, or quantizing
13 G normal values, took over 30 s before anything was measured; a copy runs at DRAM speed. For a bandwidth
measurement that is fine: the kernels decode every nibble through the same table and multiply by every
scale whatever the bytes are, and no two experts share addresses, so the caches see exactly as much data.
The pool's odd length puts each expert at a different offset in it, so the experts still differ (a
correctness check against the torch reference compares real outputs).
"""

from __future__ import annotations

import torch

MX_POOL_BYTES = (1 << 24) + 4099
MX_SCALES = (118, 122)  # E8M0 2^-9 .. 2^-6: N(0, 0.02)-sized weights, gpt-oss's range (no NaN byte 0xFF)


def fill_tiled_(t: torch.Tensor, pool: torch.Tensor) -> None:
    """Fill ``t`` (contiguous) by repeating the 1-d ``pool`` over its elements (same dtype)."""
    flat, n = t.view(-1), pool.numel()
    for start in range(0, flat.numel(), n):
        chunk = flat[start:start + n]
        chunk.copy_(pool[:chunk.numel()])


def fill_mxfp4_(*layers: dict[str, torch.Tensor], seed: int = 0) -> None:
    """Fill the banks of MXFP4 layers (each a name -> ``[E, ...]`` dict as LayerBanks.tensors) in place:
    gate_up / down random bytes (every e2m1 code in both nibbles), the E8M0 scales in MX_SCALES, any other
    bank (gpt-oss's biases) zero. One pool for all layers (drawing it is the slow part)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (MX_POOL_BYTES,), generator=g, dtype=torch.uint8)
    scales = torch.randint(MX_SCALES[0], MX_SCALES[1] + 1, (MX_POOL_BYTES // 16 + 1,), generator=g, dtype=torch.uint8)
    for tensors in layers:
        for name, t in tensors.items():
            if name in ("gate_up", "down"):
                fill_tiled_(t, codes)
            elif name.endswith("_scale"):
                fill_tiled_(t, scales)
            else:
                t.zero_()


GGUF_POOL_ROWS = 509  # rows quantized per bank width; prime, so experts start at different pool rows


def fill_gguf_(tensors: dict[str, torch.Tensor], gate_up_type, down_type, seed: int = 0) -> None:
    """Fill one GGUF layer's banks (gate_up [E, 2I, W_gu], down [E, D, W_d] uint8, rows possibly padded) in
    place with valid blocks: GGUF_POOL_ROWS rows of N(0, 0.02) values quantized to the bank's type
    (gguf_quant.quantize), repeated row by row (random bytes would make NaN / huge fp16 scales). Any
    other bank (biases) is zeroed."""
    from services.engine.moe.gguf_quant import quantize, row_bytes

    g = torch.Generator().manual_seed(seed)
    D, I = tensors["down"].shape[1], tensors["gate_up"].shape[1] // 2
    for name, t in tensors.items():
        if name not in ("gate_up", "down"):
            t.zero_()
            continue
        qtype, cols = (gate_up_type, D) if name == "gate_up" else (down_type, I)
        pool = quantize(torch.randn(GGUF_POOL_ROWS, cols, generator=g) * 0.02, qtype)  # [P, row_bytes]
        rows = t.view(-1, t.shape[-1])[:, :row_bytes(qtype, cols)]  # [E * rows, row_bytes]
        for start in range(0, rows.shape[0], GGUF_POOL_ROWS):
            chunk = rows[start:start + GGUF_POOL_ROWS]
            chunk.copy_(pool[:chunk.shape[0]])

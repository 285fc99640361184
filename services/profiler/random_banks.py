"""Random MXFP4 and GGUF expert banks, fast: what `tandem bench bw --dtype mxfp4` (or q4_K, ...) and
benchmarks/bench_cpu_executor measure on (bank names and shapes: services/engine/moe/banks.py).

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


GGUF_POOL_BLOCKS = (1 << 16) + 7  # blocks in the pool (~9-14 MB); odd, so experts start at different blocks


def fill_gguf_(bank: torch.Tensor, qtype, seed: int = 0) -> None:
    """Fill a GGUF bank uint8 [E, rows, row bytes of ``qtype``] (contiguous: whole blocks back to back) by tiling
    a pool of random valid blocks (models/gguf_random.py: every code, finite scales of N(0, 0.02)-sized
    values). The pool is whole blocks, so every block of the bank is one of the pool's."""
    from services.engine.models.gguf_random import random_blocks_
    from services.engine.moe.gguf_quant import BLOCK, GGUFType

    nbytes = BLOCK[GGUFType(qtype)][1]
    pool = torch.empty((GGUF_POOL_BLOCKS, nbytes), dtype=torch.uint8)
    random_blocks_(pool, GGUFType(qtype).value, 0.02, torch.Generator().manual_seed(seed))
    fill_tiled_(bank, pool.view(-1))

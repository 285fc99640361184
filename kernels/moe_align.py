"""Routes grouped by expert for the grouped MoE GEMM (kernels/moe_gemm.py): which padded row of which tile
computes which route, on the device, no host sync.

Legend: R routes · E experts · M = NT*BLOCK_M padded rows · NT tiles.

The tile count is padded to its upper bound NT = ceil(R / BLOCK_M) + min(E, R) (each expert present wastes at
most one partial tile), so the shapes are static and a decode step's launches can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def num_tiles(R: int, E: int, block_m: int) -> int:
    """Upper bound of the tiles of R routes over E experts: full tiles plus one partial tile per expert."""
    return triton.cdiv(R, block_m) + min(E, R)


# -- alignment ----------------------------------------------------------------------------------------------
# Two launches, no torch ops (a decode step replays them 24-48 times: each tiny launch costs ~2 us in a graph).
@triton.jit(do_not_specialize=["R"])
def _count_kernel(ids_ptr, counts_ptr, R, BLOCK_R: tl.constexpr):
    """Program e: the number of routes to expert e."""
    e = tl.program_id(0)
    n = 0
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + offs, mask=offs < R, other=-1)
        n += tl.sum((ids == e).to(tl.int32), axis=0)
    tl.store(counts_ptr + e, n)


@triton.jit(do_not_specialize=["R", "NT"])
def _place_kernel(ids_ptr, counts_ptr, routes_ptr, tiles_ptr, R, E, NT,
                  BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr):
    """Program e: expert e's tiles start after the tiles of the experts before it; it writes the indices of
    its routes there in route order, R into the padding rows of its last tile, and e as the expert of its
    tiles. The last program marks the unused tiles -1."""
    e = tl.program_id(0)
    first = 0  # tiles of the experts before e
    for e0 in range(0, E, BLOCK_E):
        offs = e0 + tl.arange(0, BLOCK_E)
        c = tl.load(counts_ptr + offs, mask=offs < e, other=0)
        first += tl.sum((c + BLOCK_M - 1) // BLOCK_M, axis=0)
    count = tl.load(counts_ptr + e)
    ntiles = (count + BLOCK_M - 1) // BLOCK_M
    row0 = first * BLOCK_M
    row = row0
    for r0 in range(0, R, BLOCK_R):
        offs = r0 + tl.arange(0, BLOCK_R)
        ids = tl.load(ids_ptr + offs, mask=offs < R, other=-1)
        hit = (ids == e).to(tl.int32)
        pos = row + tl.cumsum(hit, axis=0) - 1  # [BLOCK_R] rank among this block's hits
        tl.store(routes_ptr + pos, offs, mask=hit > 0)
        row += tl.sum(hit, axis=0)
    pad = row0 + count + tl.arange(0, BLOCK_M)  # at most BLOCK_M - 1 padding rows
    tl.store(routes_ptr + pad, tl.full([BLOCK_M], 0, tl.int32) + R, mask=pad < row0 + ntiles * BLOCK_M)
    for t0 in range(0, ntiles, BLOCK_R):
        t = t0 + tl.arange(0, BLOCK_R)
        tl.store(tiles_ptr + first + t, tl.full([BLOCK_R], 0, tl.int32) + e, mask=t < ntiles)
    if e == E - 1:
        for t0 in range(first + ntiles, NT, BLOCK_R):
            t = t0 + tl.arange(0, BLOCK_R)
            tl.store(tiles_ptr + t, tl.full([BLOCK_R], -1, tl.int32), mask=t < NT)


def align_routes(ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [R] int (-1 = skipped) -> (routes [NT*block_m] int32: the route of each padded row, R where the
    row is padding, unset in unused tiles; tile_expert [NT] int32: the expert of each tile, -1 past the used
    ones). On the device, no host sync; NT = num_tiles(R, E, block_m)."""
    R = ids.numel()
    NT = num_tiles(R, E, block_m)
    ids = ids.contiguous()
    counts = torch.empty(E, dtype=torch.int32, device=ids.device)
    routes = torch.empty(NT * block_m, dtype=torch.int32, device=ids.device)
    tile_expert = torch.empty(NT, dtype=torch.int32, device=ids.device)
    _count_kernel[(E,)](ids, counts, R, BLOCK_R=256)
    _place_kernel[(E,)](ids, counts, routes, tile_expert, R, E, NT, BLOCK_M=block_m, BLOCK_R=256, BLOCK_E=256)
    return routes, tile_expert

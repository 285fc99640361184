"""copy_tiered: ``copy_missing`` with a second source tier (docs/multi-gpu.md). Each recorded job's expert is
copied into its home slot from a peer device's slot when the peer tier holds it (NVLink / PCIe P2P), else
from the pinned host banks (PCIe), as kernels/gather_copy.py does.

Dimension legend: L MoE layers · E experts per layer · K peer devices · P slots per peer device ·
G = K*P peer slots · NB banks per expert · J job capacity.

``peer_slot_of_id [L*E] int32`` (home device) is the peer tier's table: g = k*P + p for an expert held in slot
p of peer k, else -1. The peers' slot banks are separate allocations (one per device and bank), addressed
like the host banks: one base pointer and a table of int64 byte offsets from it (``peer_delta [K, NB]``), so a
``CopyPlan`` built over the peers' banks (one "layer" per peer, P "experts" each) gives the addressing.

- ``copy_tiered_fused``: ONE Triton launch, programs ``(job, bank, chunk)`` as the fused host copy; a job's
  program reads the peer's slot (device memory of another GPU: reachable once peer access is enabled, see
  services/engine/moe/peer_cache.py) or the host bank through UVA. Both sources run in the same launch, so
  the P2P and PCIe copies of a step overlap. Program (j, 0, 0) of a peer job adds one to ``peer_fetched``
  [L]. Fixed grid, no host round trip: capturable in a CUDA graph.
- ``copy_tiered_reference``: per job and bank one ``copy_`` (reads job_count on the host): the CPU
  device's path and the tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.gather_copy import BLOCK_BYTES, CHUNK_BYTES, CopyPlan, _BytePointer


@triton.jit
def _copy_bytes(src, dst, start, end, BLOCK: tl.constexpr):
    """dst[start:end] = src[start:end], bytes; start is a multiple of BLOCK."""
    for off in range(start, end, BLOCK):
        o = tl.multiple_of(off, BLOCK) + tl.arange(0, BLOCK)
        m = o < end
        tl.store(dst + o, tl.load(src + o, mask=m), mask=m)


@triton.jit
def _copy_tiered_kernel(
    # byte bases of the host banks, the peers' slot banks and the home slot banks, and their offset tables
    host_base, peer_base, dst_base, host_delta_ptr, peer_delta_ptr, dst_delta_ptr, bank_bytes_ptr,
    # jobs of the last ensure call, the peer table and its counter
    job_src_ptr, job_dst_ptr, job_count_ptr, peer_slot_ptr, peer_fetched_ptr,
    # sizes
    E, P, NB,
    # meta-parameters
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    j = tl.program_id(0)
    b = tl.program_id(1)
    c = tl.program_id(2)
    nbytes = tl.multiple_of(tl.load(bank_bytes_ptr + b), VEC)
    start = c.to(tl.int64) * CHUNK
    active = j < tl.load(job_count_ptr)
    end = tl.where(active, tl.minimum(start + CHUNK, nbytes), start)  # unused job entries copy nothing
    end = tl.multiple_of(end, VEC)
    flat = tl.load(job_src_ptr + j)
    g = tl.load(peer_slot_ptr + flat)  # stale entries of unused jobs still name a valid expert
    dst_off = tl.multiple_of(tl.load(dst_delta_ptr + b), VEC) + tl.load(job_dst_ptr + j).to(tl.int64) * nbytes
    layer = flat // E
    if g >= 0:  # the peer holds it: device -> device
        k = g // P
        src_off = tl.multiple_of(tl.load(peer_delta_ptr + k * NB + b), VEC) + (g - k * P).to(tl.int64) * nbytes
        _copy_bytes(peer_base + src_off, dst_base + dst_off, start, end, BLOCK)
        if active & (b == 0) & (c == 0):
            tl.atomic_add(peer_fetched_ptr + layer, 1)
    else:  # host -> device over PCIe
        src_off = (tl.multiple_of(tl.load(host_delta_ptr + layer * NB + b), VEC)
                   + (flat - layer * E).to(tl.int64) * nbytes)
        _copy_bytes(host_base + src_off, dst_base + dst_off, start, end, BLOCK)


def check_plans(host: CopyPlan, peer: CopyPlan) -> None:
    """The peer plan copies the same banks, in the same order and shapes, into the same home slots."""
    if host.names != peer.names or host.bank_bytes != peer.bank_bytes or host.dst_base.data_ptr() != peer.dst_base.data_ptr():
        raise ValueError(f"peer copy: the peer slot banks {peer.names} {peer.bank_bytes} do not match the host "
                         f"banks {host.names} {host.bank_bytes} or target other home slots")


def copy_tiered_fused(host: CopyPlan, peer: CopyPlan, job_src: torch.Tensor, job_dst: torch.Tensor,
                      job_count: torch.Tensor, peer_slot_of_id: torch.Tensor, peer_fetched: torch.Tensor,
                      max_jobs: int | None = None) -> None:
    """One launch for every job < job_count and every bank (module docstring). host: the cache's plan
    (host banks -> home slots) · peer: a plan over the peers' slot banks (one "layer" of P per peer) into the
    same home slots · job_src / job_dst [J] int32 · job_count [1] int32 · peer_slot_of_id [L*E] int32 ·
    peer_fetched [L] int64, all on the home device · max_jobs: as gather_copy.copy_fused."""
    J, NB = job_src.shape[0], len(host.names)
    if max_jobs is not None:
        J = max(1, min(J, max_jobs))
    grid = (J, NB, triton.cdiv(max(host.bank_bytes), CHUNK_BYTES))
    if host.dst_base.is_cuda:
        bases = [_BytePointer(t) for t in (host.src_base, peer.src_base, host.dst_base)]
    else:  # the interpreter (tests) wants real tensors; byte views share the banks' storage
        bases = [t.view(torch.uint8) for t in (host.src_base, peer.src_base, host.dst_base)]
    _copy_tiered_kernel[grid](
        *bases, host.src_delta, peer.src_delta, host.dst_delta, host.bank_bytes_t,
        job_src, job_dst, job_count, peer_slot_of_id, peer_fetched,
        host.num_experts, peer.num_experts, NB,
        CHUNK=CHUNK_BYTES, BLOCK=BLOCK_BYTES, VEC=min(host.vec, peer.vec), num_warps=8,
    )


def copy_tiered_reference(host: CopyPlan, peer: CopyPlan, job_src: torch.Tensor, job_dst: torch.Tensor,
                          job_count: torch.Tensor, peer_slot_of_id: torch.Tensor, peer_fetched: torch.Tensor) -> None:
    """Per job and bank one ``copy_`` from the peer slot or the host bank (a host sync on job_count). Same
    arguments and effect as :func:`copy_tiered_fused`."""
    n = int(job_count[0])
    if n == 0:
        return
    E, P = host.num_experts, peer.num_experts
    flats = job_src[:n].tolist()
    peers = peer_slot_of_id[job_src[:n].long()].tolist()
    for flat, slot, g in zip(flats, job_dst[:n].tolist(), peers):
        for name in host.names:
            src = peer.host_layers[g // P][name][g % P] if g >= 0 else host.host_layers[flat // E][name][flat % E]
            host.slot_banks[name][slot].copy_(src, non_blocking=True)
        if g >= 0:
            peer_fetched[flat // E] += 1

"""copy_missing: copy the recorded jobs of ensure_experts (host expert -> device slot) for every bank.

Dimension legend: L MoE layers · E experts per layer · S slots · NB banks per expert (bf16: gate_up, down) ·
J job capacity (C of the cache) · n jobs recorded (job_count, known only on the device).

Two implementations (the cache uses the fused one; `tandem bench cache-copy` compares them):
- ``fused``: ONE Triton launch for all jobs and all banks. Programs ``(job, bank, chunk)`` read pinned host
  memory through its UVA device pointer and write the slot; programs of jobs >= job_count do nothing, so
  the launch has a fixed grid and no host round trip (capturable in a CUDA graph). Per-bank launches cost
  ~18.6 µs each on the H200 host (docs/design.md §6); one launch pays that once.
- ``per-bank``: for each bank, one ``copy_`` per job (reads job_count on the host: a sync). The A/B
  baseline, and the path on CPU devices, where the "device" slots are ordinary memory.

Host banks are separate allocations (one tensor per layer and bank), so the kernel takes one base pointer
and a table of int64 byte offsets from it (``src_delta[L, NB]``); likewise for the slot banks.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

# Bytes per program: 64 KiB keeps ~1k programs in flight for 8 experts of 9.4 MB (enough outstanding PCIe
# reads to cover latency) while the empty programs of unused job entries stay cheap.
CHUNK_BYTES = 64 * 1024
BLOCK_BYTES = 8 * 1024


class CopyMode(str, enum.Enum):
    FUSED = "fused"
    PER_BANK = "per-bank"


class _BytePointer:
    """What Triton needs of a pointer argument: ``data_ptr()`` and ``dtype`` (bytes, whatever the bank's
    dtype). For pinned host memory the host address is also its device address (UVA), so the kernel reads
    it directly over PCIe."""

    def __init__(self, tensor: torch.Tensor):
        self._ptr = tensor.data_ptr()
        self.dtype = torch.uint8

    def data_ptr(self) -> int:
        return self._ptr


class CopyPlan:
    """The fixed addressing of one (host banks, slot banks) pair: built once, reused every step.

    host_layers: per MoE layer, ``{bank name: [E, ...] host tensor}`` (pinned when copying to CUDA) ·
    slot_banks: ``{bank name: [S, ...] device tensor}`` with the same per-expert shape and dtype.
    """

    def __init__(self, host_layers: list[dict[str, torch.Tensor]], slot_banks: dict[str, torch.Tensor]):
        self.names = list(slot_banks)
        self.host_layers = host_layers
        self.slot_banks = slot_banks
        self.num_experts = next(iter(host_layers[0].values())).shape[0]
        device = next(iter(slot_banks.values())).device
        for l, layer in enumerate(host_layers):
            for name in self.names:
                h, d = layer[name], slot_banks[name]
                if h.shape[1:] != d.shape[1:] or h.dtype != d.dtype or not h.is_contiguous():
                    raise ValueError(f"copy plan: host bank {name!r} of layer {l} is {tuple(h.shape)} {h.dtype} "
                                     f"(contiguous={h.is_contiguous()}); slots are {tuple(d.shape)} {d.dtype}")
        self.bank_bytes = [slot_banks[n][0].numel() * slot_banks[n].element_size() for n in self.names]
        self.src_base = host_layers[0][self.names[0]]
        self.dst_base = slot_banks[self.names[0]]
        src = [[layer[n].data_ptr() - self.src_base.data_ptr() for n in self.names] for layer in host_layers]
        dst = [slot_banks[n].data_ptr() - self.dst_base.data_ptr() for n in self.names]
        self.src_delta = torch.tensor(src, dtype=torch.int64, device=device)  # [L, NB]
        self.dst_delta = torch.tensor(dst, dtype=torch.int64, device=device)  # [NB]
        self.bank_bytes_t = torch.tensor(self.bank_bytes, dtype=torch.int64, device=device)  # [NB]
        addresses = [t.data_ptr() for layer in host_layers for t in layer.values()]
        addresses += [t.data_ptr() for t in slot_banks.values()]
        # 16-byte vectors only when every address and every per-expert size allows them
        self.vec = 16 if all(a % 16 == 0 for a in addresses) and all(b % 16 == 0 for b in self.bank_bytes) else 1

    def expert_nbytes(self) -> int:
        return sum(self.bank_bytes)


@triton.jit
def _copy_jobs_kernel(
    # pointers: byte bases of the host and slot banks, offset tables
    src_base, dst_base, src_delta_ptr, dst_delta_ptr, bank_bytes_ptr,
    # jobs of the last ensure call
    job_src_ptr, job_dst_ptr, job_count_ptr,
    # sizes
    E, NB,
    # meta-parameters
    CHUNK: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
):
    j = tl.program_id(0)
    b = tl.program_id(1)
    c = tl.program_id(2)
    nbytes = tl.multiple_of(tl.load(bank_bytes_ptr + b), VEC)
    start = c.to(tl.int64) * CHUNK
    end = tl.minimum(start + CHUNK, nbytes)
    end = tl.where(j < tl.load(job_count_ptr), end, start)  # unused job entries copy nothing
    # every bound is a multiple of VEC: say so, or the mask below would split 16-byte vectors into bytes
    end = tl.multiple_of(end, VEC)
    flat = tl.load(job_src_ptr + j)
    slot = tl.load(job_dst_ptr + j).to(tl.int64)
    layer = flat // E
    expert = (flat - layer * E).to(tl.int64)
    src_off = tl.multiple_of(tl.load(src_delta_ptr + layer * NB + b), VEC) + expert * nbytes
    dst_off = tl.multiple_of(tl.load(dst_delta_ptr + b), VEC) + slot * nbytes
    for off in range(start, end, BLOCK):
        o = tl.multiple_of(off, BLOCK) + tl.arange(0, BLOCK)  # start = c * CHUNK, CHUNK % BLOCK == 0
        m = o < end
        x = tl.load(src_base + src_off + o, mask=m)
        tl.store(dst_base + dst_off + o, x, mask=m)


def copy_fused(plan: CopyPlan, job_src: torch.Tensor, job_dst: torch.Tensor, job_count: torch.Tensor,
               max_jobs: int | None = None) -> None:
    """One launch: every job < job_count, every bank. job_src/job_dst [J] int32 (flat id, slot) ·
    job_count [1] int32, all on the slot banks' device. ``max_jobs``: a bound on job_count known from the
    shapes (e.g. T*A at decode) that trims the grid; the grid stays a function of shapes (capturable)."""
    J, NB = job_src.shape[0], len(plan.names)
    if max_jobs is not None:
        J = max(1, min(J, max_jobs))
    grid = (J, NB, triton.cdiv(max(plan.bank_bytes), CHUNK_BYTES))
    if plan.dst_base.is_cuda:
        src, dst = _BytePointer(plan.src_base), _BytePointer(plan.dst_base)
    else:  # the interpreter (tests) wants real tensors; these byte views share the banks' storage
        src, dst = plan.src_base.view(torch.uint8), plan.dst_base.view(torch.uint8)
    _copy_jobs_kernel[grid](
        src, dst, plan.src_delta, plan.dst_delta, plan.bank_bytes_t,
        job_src, job_dst, job_count,
        plan.num_experts, NB,
        CHUNK=CHUNK_BYTES, BLOCK=BLOCK_BYTES, VEC=plan.vec, num_warps=8,
    )


def copy_per_bank(plan: CopyPlan, job_src: torch.Tensor, job_dst: torch.Tensor, job_count: torch.Tensor) -> None:
    """Per bank, one ``copy_`` per job (host sync on job_count). Same arguments as :func:`copy_fused`."""
    n = int(job_count[0])
    if n == 0:
        return
    E = plan.num_experts
    jobs = list(zip(job_src[:n].tolist(), job_dst[:n].tolist()))
    for name in plan.names:
        slots = plan.slot_banks[name]
        for flat, slot in jobs:
            slots[slot].copy_(plan.host_layers[flat // E][name][flat % E], non_blocking=True)


def copy_missing(plan: CopyPlan, job_src: torch.Tensor, job_dst: torch.Tensor, job_count: torch.Tensor,
                 mode: CopyMode = CopyMode.FUSED, max_jobs: int | None = None, use_kernel: bool | None = None) -> None:
    """Copy the recorded jobs host -> slots: the fused kernel on CUDA (unless ``mode`` is per-bank), the
    per-bank torch copy otherwise (CPU devices: the slots are ordinary memory). ``use_kernel=True`` runs the
    kernel on CPU tensors too (under TRITON_INTERPRET, for tests)."""
    if use_kernel is None:
        use_kernel = plan.dst_base.is_cuda
    if mode is CopyMode.FUSED and use_kernel:
        copy_fused(plan, job_src, job_dst, job_count, max_jobs)
    else:
        copy_per_bank(plan, job_src, job_dst, job_count)

"""Device side of the graph-mode CPU handoff (services/engine/moe/cpu_handoff.py GraphHandoff): two tiny
kernels that talk to the CPU executor's poller through pinned host words (UVA), so a
hybrid decode layer is all copies and kernels and can be captured in a CUDA graph.

Dimension legend: T tokens · D hidden.

- ``stage_and_signal``: stores hidden/ids/weights straight into the pinned inputs (UVA), fences them
  system-wide, then seq += 1 (device counter) and job word = seq << 20 | T << 10 | layer in host
  memory: one kernel node per layer instead of three copy nodes and a kernel (each node ~2-3 us of
  latency on the GPU's timeline, in series with the CPU's work).
- ``signal_cpu``: the word alone, for inputs the stream already copied down.
- ``wait_cpu_add``: polls the host done word until it reaches seq, then out = part + cpu_out (cpu_out
  [T, D] fp32 read from pinned memory with volatile loads: never a stale cached line of an earlier layer);
  one program per WAIT_BLOCK elements, each polling the word itself (many tokens per step: the read of
  the CPU's output over PCIe is spread over programs instead of one).
  A bounded poll (``max_polls``) turns a lost CPU job into NaNs instead of a hung GPU.
Both optionally stamp %globaltimer (ns) into pinned ``stamps [L, 3]``: signal, wait entry, wait exit —
the GPU side's time (copy_missing + GEMM) and how long it waited for the CPU — and the wait mirrors the
layer's cache counters to pinned memory: the split controller's thread reads all of it with plain
loads, no CUDA call (a CUDA call from another thread would break a graph capture in progress).

Triton is imported and the kernels defined on first use (TRITON_INTERPRET: see kernels/ensure_experts_hybrid.py).
"""

from __future__ import annotations

import torch

JOB_SEQ_SHIFT = 20  # job word = seq << 20 | T << 10 | layer
WAIT_BLOCK = 4096  # elements of the CPU's output added per program of wait_cpu_add (T = 32, D = 2048: 16 programs)
_KERNELS = None


class HostWord:
    """A Triton pointer argument for pinned host memory: its host address is its device address (UVA)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # keep alive
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()


def host_arg(kernel, t: torch.Tensor):
    """Pinned host tensor as a kernel argument: its UVA address on a GPU; the tensor itself under the
    interpreter (which copies tensor arguments in and out around the launch)."""
    return t if type(kernel).__name__ == "InterpretedFunction" else HostWord(t)


def _kernels():
    global _KERNELS, triton, tl, _now
    if _KERNELS is not None:
        return _KERNELS
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import globaltimer as _now

    # the ints that change per layer and per step (layer, T in ``code``, n_r = T x A) are do_not_specialize:
    # Triton would compile a variant per layer == 1 / layer % 16 == 0 / other and per n_r % 16, and the
    # start-up warm-up (one layer, a few sizes) would leave those compiles to requests. n and n_h (T x D)
    # stay specialized: D % 16 == 0 in every model, so they always divide by 16 (vectorized loads)
    @triton.jit(do_not_specialize=["code", "layer"])
    def _signal_kernel(seq_ptr, job_ptr, stamps_ptr, code, layer, TIMER: tl.constexpr):
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        if TIMER:
            tl.store(stamps_ptr + layer * 3, _now())
        tl.store(job_ptr, (seq << 20) | code)

    @triton.jit(do_not_specialize=["layer"])
    def _wait_add_kernel(seq_ptr, done_ptr, cpu_ptr, part_ptr, out_ptr, stamps_ptr, layer, n, max_polls,
                         misses_ptr, fetched_ptr, counters_ptr,
                         TIMER: tl.constexpr, COUNTERS: tl.constexpr, GPU: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)  # each program waits for the done word itself, then adds its BLOCK elements
        first = pid == 0
        target = tl.load(seq_ptr)
        if COUNTERS:  # the layer's cumulative miss/fetch counters, mirrored to host memory
            tl.store(counters_ptr + layer * 2, tl.load(misses_ptr + layer), mask=first)
            tl.store(counters_ptr + layer * 2 + 1, tl.load(fetched_ptr + layer), mask=first)
        if TIMER:
            tl.store(stamps_ptr + layer * 3 + 1, _now(), mask=first)
        done = tl.load(done_ptr, volatile=True)
        polls = tl.full([], 0, tl.int32)  # a tensor from the start: loop-carried types must not change
        while (done < target) & (polls < max_polls):
            done = tl.load(done_ptr, volatile=True)
            polls += 1
        if GPU:  # volatile loads are relaxed: acquire before reading what the CPU wrote before `done`
            tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)
        if TIMER:
            tl.store(stamps_ptr + layer * 3 + 2, _now(), mask=first)
        ok = done >= target
        idx = pid * BLOCK + tl.arange(0, BLOCK)
        m = idx < n
        c = tl.load(cpu_ptr + idx, mask=m, other=0.0, volatile=True)
        p = tl.load(part_ptr + idx, mask=m, other=0.0).to(tl.float32)
        r = tl.where(ok, p + c, float("nan"))
        tl.store(out_ptr + idx, r.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["code", "layer", "n_r"])
    def _stage_signal_kernel(seq_ptr, job_ptr, stamps_ptr, code, layer, h_src, h_dst, n_h, i_src, i_dst, w_src, w_dst,
                             n_r, TIMER: tl.constexpr, GPU: tl.constexpr, BLOCK: tl.constexpr, RBLOCK: tl.constexpr):
        for i0 in range(0, n_h, BLOCK):  # hidden [T, D] -> pinned, converted to the buffer's dtype
            idx = i0 + tl.arange(0, BLOCK)
            m = idx < n_h
            tl.store(h_dst + idx, tl.load(h_src + idx, mask=m).to(h_dst.dtype.element_ty), mask=m)
        r = tl.arange(0, RBLOCK)  # ids, weights [T, A]
        mr = r < n_r
        tl.store(i_dst + r, tl.load(i_src + r, mask=mr).to(i_dst.dtype.element_ty), mask=mr)
        tl.store(w_dst + r, tl.load(w_src + r, mask=mr).to(w_dst.dtype.element_ty), mask=mr)
        if GPU:  # each thread's host stores visible system-wide, then all threads past them, then the word
            tl.inline_asm_elementwise("fence.sc.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
            tl.debug_barrier()
        seq = tl.load(seq_ptr) + 1
        tl.store(seq_ptr, seq)
        if TIMER:
            tl.store(stamps_ptr + layer * 3, _now())
        tl.store(job_ptr, (seq << 20) | code)

    _KERNELS = (_signal_kernel, _wait_add_kernel, _stage_signal_kernel)
    return _KERNELS


def signal_cpu(seq: torch.Tensor, job_word: torch.Tensor, layer: int, T: int, stamps: torch.Tensor | None = None) -> None:
    """seq [1] int64 (device) += 1; job_word (pinned int64 [1] host tensor) = seq << 20 | T << 10 | layer;
    stamps: pinned int64 [L, 3] (GPU only)."""
    signal = _kernels()[0]
    if not (0 <= layer < 1024 and 0 < T < 1024):
        raise ValueError(f"cpu handoff: layer {layer} and T {T} must fit in 10 bits each")
    timer = stamps is not None
    signal[(1,)](seq, host_arg(signal, job_word), host_arg(signal, stamps) if timer else seq, (T << 10) | layer, layer,
                 TIMER=timer)


def stage_and_signal(seq: torch.Tensor, job_word: torch.Tensor, layer: int, hidden: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor, hidden_h: torch.Tensor, ids_h: torch.Tensor, w_h: torch.Tensor,
                     stamps: torch.Tensor | None = None) -> None:
    """hidden [T, D] · ids [T, A] · weights [T, A] (device) -> the first T rows of the pinned hidden_h /
    ids_h / w_h, then as ``signal_cpu``: seq [1] int64 (device) += 1, job word (pinned int64 [1]) =
    seq << 20 | T << 10 | layer. One single-program launch; stamps: pinned int64 [L, 3] (GPU only)."""
    stage = _kernels()[2]
    T = hidden.shape[0]
    if not (0 <= layer < 1024 and 0 < T < 1024):
        raise ValueError(f"cpu handoff: layer {layer} and T {T} must fit in 10 bits each")
    n_h, n_r = hidden.numel(), ids.numel()
    timer = stamps is not None
    h = lambda t: host_arg(stage, t)  # noqa: E731
    stage[(1,)](seq, h(job_word), h(stamps) if timer else seq, (T << 10) | layer, layer,
                hidden.contiguous(), h(hidden_h[:T]), n_h, ids.contiguous(), h(ids_h[:T]), weights.contiguous(),
                h(w_h[:T]), n_r, TIMER=timer, GPU=type(stage).__name__ != "InterpretedFunction",
                BLOCK=min(4096, triton.next_power_of_2(n_h)), RBLOCK=triton.next_power_of_2(max(n_r, 2)))


def wait_cpu_add(seq: torch.Tensor, done_word: torch.Tensor, cpu_out: torch.Tensor, part: torch.Tensor, layer: int,
                 stamps: torch.Tensor | None = None, max_polls: int = 1 << 26,
                 counters: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Wait (on the device) for the CPU job of the current seq (done_word: pinned int64 [1]), then return
    part [T, D] + cpu_out [T, D] (pinned fp32)
    (fp32 sum, in part's dtype); NaNs if the CPU never answered within ``max_polls`` polls.
    stamps: pinned int64 [L, 3] (GPU only) · counters: (misses [L], fetched [L] on the device, pinned
    int64 [L, 2]) to mirror the layer's cache counters to the host, read there with no CUDA call."""
    wait_add = _kernels()[1]
    out = torch.empty_like(part)
    n = part.numel()
    timer = stamps is not None
    misses, fetched, mirror = counters if counters is not None else (seq, seq, None)
    block = min(WAIT_BLOCK, triton.next_power_of_2(n))
    # one program per block: reading the CPU's output from pinned memory is latency-bound per program
    # (one program read [32, 2048] fp32, 256 KB, over PCIe far slower than the link allows)
    wait_add[(triton.cdiv(n, block),)](seq, host_arg(wait_add, done_word), host_arg(wait_add, cpu_out), part.contiguous(), out,
                   host_arg(wait_add, stamps) if timer else seq, layer, n, max_polls,
                   misses, fetched, host_arg(wait_add, mirror) if mirror is not None else seq,
                   TIMER=timer, COUNTERS=counters is not None, GPU=type(wait_add).__name__ != "InterpretedFunction",
                   BLOCK=block)
    return out

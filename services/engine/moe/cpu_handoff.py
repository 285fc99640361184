"""Handing the CPU executor's work to and from a CUDA device (services/engine/moe/cpu_executor.py does the
compute): DeviceHandoff, the eager path (pinned buffers and a polled flag word, one C++ call per submit
and per sync), and GraphHandoff, the CUDA-graph-capturable path (kernels/cpu_handoff.py on the device).

Dimension legend: T tokens · A routes per token · D hidden · L MoE layers.
"""

from __future__ import annotations

import torch

from services.common.logging import get_logger
from services.engine.moe.cpu_executor import CpuExecutor

log = get_logger("engine.cpu_handoff")


class DeviceHandoff:
    """Runs an executor job for tensors living on a CUDA device without blocking the host on the GPU.

    submit(): the stream copies hidden/ids/weights into pinned buffers and then a flag value into a
    pinned word; the workers poll the word, so the host returns at once and the GPU stream is never
    stalled. sync(): wait for the CPU, then queue the result's upload (non-blocking) and return it.
    The pinned output is safe to reuse: the next job's workers start only after the next flag, which
    the stream writes after this result's upload.

    Fast path (default): one C++ call per submit and per sync, enqueuing the copies with the CUDA
    driver API (csrc/cuda_driver.h) and the flag as an 8-byte copy from a device ring of values; the
    torch path (``fast=False``, or when the driver cannot be linked) spends ~6 torch ops per layer.
    sync() then returns a view of a device buffer that the next sync() overwrites in stream order:
    consume it on the same stream before that (hybrid adds it at once).
    """

    RING = 64  # flag values cycle 1..RING: consecutive jobs always see a new value

    def __init__(self, executor: CpuExecutor, device: torch.device, max_tokens: int, D: int, A: int,
                 dtype: torch.dtype, fast: bool = True):
        self.executor, self.device = executor, device
        self.D, self.A, self.dtype = D, A, dtype
        self.flag_h = torch.zeros(1, dtype=torch.int64).pin_memory()
        self.flag_d = torch.zeros(1, dtype=torch.int64, device=device)
        self.ring_d = torch.arange(1, self.RING + 1, dtype=torch.int64, device=device)  # [RING]
        self.seq = 0
        self.T = 0
        self.fast = self._fast_verified = False
        self._alloc(max_tokens)
        if fast:
            try:
                self._link()
                self.fast = True
            except RuntimeError as exc:
                log.warning("cpu handoff: driver fast path unavailable, using torch copies (~6 ops per layer): %s", exc)
        self._stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # an int, no Stream object
        self._index = device.index if device.index is not None else torch.cuda.current_device()

    def _alloc(self, T: int) -> None:
        self.capacity = T
        self.hidden_h = torch.empty((T, self.D), dtype=self.dtype).pin_memory()  # [T, D]
        self.ids_h = torch.empty((T, self.A), dtype=torch.int64).pin_memory()  # [T, A]
        self.w_h = torch.empty((T, self.A), dtype=torch.float32).pin_memory()  # [T, A]
        self.out_h = torch.empty((T, self.D), dtype=torch.float32).pin_memory()  # [T, D]
        self.out_d = torch.empty((T, self.D), dtype=torch.float32, device=self.device)  # [T, D] upload target
        self._out_views = [self.out_d[:t] for t in range(T + 1)]

    def _link(self) -> None:
        layers = self.executor.banks.layers
        self.executor._impl.link_device(self.hidden_h, self.ids_h, self.w_h, self.out_h, self.flag_h,
                                        self.ring_d.data_ptr(), self.RING,
                                        [lb.ordered() for lb in layers])

    def _stream(self) -> int:
        if self._stream_of is not None:
            return self._stream_of(self._index)
        return torch.cuda.current_stream(self.device).cuda_stream

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """hidden [T, D] · ids [T, A] (-1 = not for the CPU) · weights [T, A], all on ``device``."""
        T = hidden.shape[0]
        if T > self.capacity:
            torch.cuda.current_stream(self.device).synchronize()  # old buffers may still be in flight
            self._alloc(max(T, 2 * self.capacity))
            if self.fast:
                self._link()
        if self.fast:
            if hidden.dtype != self.dtype:
                hidden = hidden.to(self.dtype)
            if ids.dtype != torch.int64:
                ids = ids.long()
            if weights.dtype != torch.float32:
                weights = weights.float()
            ex = self.executor
            if ex._pending is not None:
                raise RuntimeError("cpu handoff: submit() while a job is in flight; call sync() first")
            try:
                ex._impl.device_submit(layer, hidden.contiguous(), ids.contiguous(), weights.contiguous(),
                                       self._stream())
                ex._pending = (hidden, ids, weights, None, "device")
                self.T = T
                return
            except RuntimeError as exc:  # nothing was dispatched; before a first success, fall back
                if self._fast_verified:
                    raise
                log.warning("cpu handoff: driver fast path failed on first use, using torch copies: %s", exc)
                self.fast = False
                self.seq = self.RING  # torch-path flag values start above any ring value already written
        self.hidden_h[:T].copy_(hidden, non_blocking=True)
        self.ids_h[:T].copy_(ids, non_blocking=True)
        self.w_h[:T].copy_(weights, non_blocking=True)
        self.seq += 1
        self.flag_d.fill_(self.seq)
        self.flag_h.copy_(self.flag_d, non_blocking=True)  # stream order: lands after the inputs
        self.executor.submit(self.hidden_h[:T], self.ids_h[:T], self.w_h[:T], layer, out=self.out_h[:T],
                             ready=self.flag_h, ready_value=self.seq)

    def sync(self) -> torch.Tensor:
        """Wait for the CPU job; returns its ``out [T, D]`` fp32 on ``device`` (upload queued on the stream)."""
        if not self.fast:
            out = self.executor.wait()
            return out.to(self.device, non_blocking=True)
        ex = self.executor
        if ex._pending is None:
            raise RuntimeError("cpu handoff: sync() without a submitted job")
        try:
            ex.last_ready_ns, ex.last_done_ns, ex.last_experts, ex.last_routes = ex._impl.device_sync(
                self.out_d.data_ptr(), self._stream())
        finally:
            ex._pending = None
        self._fast_verified = True
        return self._out_views[self.T]


class GraphHandoff:
    """The CUDA-graph-capturable handoff: every per-layer step is a copy or a kernel, no Python on the
    CPU side. The executor's poller thread watches a pinned job word that ``submit`` has the stream
    write (kernels/cpu_handoff.py) after copying the inputs into pinned buffers; ``sync_add`` is a kernel
    that waits for the pinned done word and adds the CPU's output. Pinned ``stamps [L, 3]`` (ns) keep
    each layer's signal / wait-entry / wait-exit times of the last step and pinned ``counters [L, 2]`` the
    cache's cumulative misses / fetches, for the split controller (host reads, no CUDA call).
    Buffers are fixed at ``max_tokens`` rows (graphs capture addresses); the banks are registered per
    layer at construction (build this after the banks are pinned).
    """

    def __init__(self, executor: CpuExecutor, device: torch.device, max_tokens: int, D: int, A: int,
                 dtype: torch.dtype):
        self.executor, self.device, self.capacity, self.A = executor, device, max_tokens, A
        pin = dict(pin_memory=torch.cuda.is_available())  # unpinned only in CPU tests (interpreter)
        self.hidden_h = torch.zeros((max_tokens, D), dtype=dtype, **pin)  # [T, D]
        self.ids_h = torch.full((max_tokens, A), -1, dtype=torch.int64, **pin)  # [T, A]
        self.w_h = torch.zeros((max_tokens, A), dtype=torch.float32, **pin)  # [T, A]
        self.out_h = torch.zeros((max_tokens, D), dtype=torch.float32, **pin)  # [T, D]
        self.job_h = torch.zeros(1, dtype=torch.int64, **pin)
        self.done_h = torch.zeros(1, dtype=torch.int64, **pin)
        self.seq = torch.zeros(1, dtype=torch.int64, device=device)
        layers = executor.banks.layers
        timed = device.type == "cuda"  # %globaltimer stamps need a GPU
        self.stamps = torch.zeros((len(layers), 3), dtype=torch.int64, **pin) if timed else None  # [L, 3] ns
        self.counters = torch.zeros((len(layers), 2), dtype=torch.int64, **pin)  # [L, 2] misses, fetched
        executor._impl.start_polling(self.job_h, self.done_h, self.hidden_h, self.ids_h, self.w_h, self.out_h,
                                     [lb.ordered() for lb in layers])

    def submit(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        """hidden [T, D] · ids [T, A] (-1 = not for the CPU) · weights [T, A] on the device; T <= max_tokens."""
        from kernels.cpu_handoff import stage_and_signal

        T = hidden.shape[0]
        if T > self.capacity:
            raise ValueError(f"graph handoff: {T} tokens exceed the {self.capacity} rows of its pinned buffers")
        # one kernel stores the inputs into the pinned buffers (UVA), fences, then writes the job word
        stage_and_signal(self.seq, self.job_h, layer, hidden, ids, weights, self.hidden_h, self.ids_h, self.w_h,
                         self.stamps)

    def sync_add(self, layer: int, part: torch.Tensor, cache_counters: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> torch.Tensor:
        """part [T, D] (the GPU's share) + the CPU's output, once the CPU is done (waited for on the device).
        cache_counters: the cache's (misses [L], fetched [L]) to mirror into ``self.counters``."""
        from kernels.cpu_handoff import wait_cpu_add

        mirror = (*cache_counters, self.counters) if cache_counters is not None else None
        return wait_cpu_add(self.seq, self.done_h, self.out_h[: part.shape[0]], part, layer, self.stamps,
                            counters=mirror)

    def poll_stats(self) -> dict:
        """Totals since start: jobs, compute seconds, experts and routes computed, last seq, last error."""
        (jobs, compute_ns, experts, routes, last_seq), error = self.executor._impl.poll_stats()
        return {"jobs": jobs, "compute_s": compute_ns * 1e-9, "experts": experts, "routes": routes,
                "last_seq": last_seq, "error": error}

    def close(self) -> None:
        self.executor._impl.stop_polling()

"""CPU MoE executor: computes routed experts on the CPU, reading the host banks in place.

Dimension legend: T tokens · A routes per token · E experts · D hidden · I expert intermediate.

The work runs in a C++ extension (``csrc/``): a persistent pool of worker threads, one per physical core
and pinned, that splits the rows of each expert's gate_up and down GEMVs across cores (at bs=1 the
parallelism is *inside* the expert GEMVs) with AVX-512-BF16 / AVX-512 / AVX2 / scalar kernels picked at
run time. Plain per-expert torch calls reach ~60 of 103 GB/s DRAM read on the H200 host (DESIGN.md §6);
the decode GEMV is bandwidth-bound, so that gap is the reason for the extension.

The extension is compiled from source once per (Python, torch) pair into a cache directory
(``TANDEM_EXT_DIR``). The install step builds it ahead of time::

    .venv/bin/python -m services.engine.moe.cpu_executor --build

There is deliberately no pure-torch fallback: a build failure raises with the compiler's reason.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from services.common.logging import get_logger
from services.common.settings import env
from services.engine.moe.banks import ExpertBanks, LayerBanks

log = get_logger("engine.cpu_executor")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("executor.cpp", "gemv.cpp")
_EXTENSION = None


def extension_dir() -> Path:
    """Where the compiled extension is cached: $TANDEM_EXT_DIR or $XDG_CACHE_HOME/tandem/ext, one
    subdirectory per (Python, torch) pair because the binary links against both."""
    root = env("TANDEM_EXT_DIR")
    if not root:
        root = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem" / "ext")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__.replace('+', '_')}"
    return Path(root) / tag


def build_extension(verbose: bool = False):
    """Compile (or load the cached) C++ executor extension and return the module.

    Raises RuntimeError naming the sources, the build directory and the compiler's message on failure.
    """
    global _EXTENSION
    if _EXTENSION is not None:
        return _EXTENSION
    from torch.utils import cpp_extension

    build_dir = extension_dir()
    build_dir.mkdir(parents=True, exist_ok=True)
    # ninja from the `engine` extra must be found even when its bin dir is not on PATH (venv not
    # activated, or installed with pip --target): the pip package says where its binary is
    bins = [str(Path(sys.executable).parent)]
    try:
        import ninja

        bins.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    os.environ["PATH"] = os.pathsep.join([b for b in bins if b not in path] + path)
    sources = [str(_CSRC / s) for s in _SOURCES]
    t0 = time.perf_counter()
    try:
        _EXTENSION = cpp_extension.load(
            name="tandem_cpu_moe",
            sources=sources,
            extra_cflags=["-O3", "-fno-math-errno"],  # the C++ standard: torch's default (its headers need it)
            extra_ldflags=["-lpthread"],
            build_directory=str(build_dir),
            verbose=verbose,
        )
    except Exception as exc:  # noqa: BLE001 - re-raised with the context a user needs
        raise RuntimeError(
            f"cpu executor: building the C++ extension from {', '.join(sources)} in {build_dir} failed "
            f"(needs a C++17 compiler and ninja; rebuild with `python -m services.engine.moe.cpu_executor "
            f"--build --verbose` for the compiler log): {exc}"
        ) from exc
    log.info("cpu executor extension ready (%s, %.1f s, isa %s)", build_dir, time.perf_counter() - t0,
             _EXTENSION.select_isa(""))
    return _EXTENSION


def physical_cpus() -> list[int]:
    """One logical CPU per physical core among those this process may run on (SMT siblings dropped:
    two threads streaming DRAM from one core share its load ports and gain nothing)."""
    allowed = sorted(os.sched_getaffinity(0))
    seen: set[tuple[str, str]] = set()
    cpus = []
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = (str(cpu), "")
        if key not in seen:
            seen.add(key)
            cpus.append(cpu)
    return cpus


def default_num_threads(leave_driver_core: bool) -> int:
    """Workers for a pool: one per physical core, minus one left to the thread that drives the GPU
    when ``leave_driver_core`` (pinned spinning workers on every core starve it: measured 5x slower
    small jobs on the 2-core CI machine with all cores taken)."""
    cores = len(physical_cpus())
    return cores - 1 if leave_driver_core and cores > 2 else cores


class CpuExecutor:
    """Routed experts of one MoE layer on the CPU, asynchronously.

    ``submit(hidden [T, D], ids [T, A], weights [T, A], layer)`` returns at once; ``wait()`` returns
    ``out [T, D]`` fp32 = sum over routes with id >= 0 of weight * SwiGLU expert(hidden[t]). Banks are
    read in place (bf16 or fp32). One job in flight at a time.
    """

    SPIN_US_SPARE_CORE = 5000  # a decode layer's gap between CPU jobs is ~0.1-1 ms: spin through it
    SPIN_US_SHARED = 200  # every core has a worker: the caller needs the cores back soon

    def __init__(self, banks: ExpertBanks, num_threads: int | None = None, spin_us: int | None = None, isa: str = ""):
        """num_threads: workers (default one per physical core, each pinned to its core); spin_us: how
        long idle workers and wait() spin before sleeping (default: 5 ms when a core is left for the
        caller, else 200 us: a sleeping pool costs a futex wake of every worker, serialised on one
        mutex, on the next job; a sleeping wait() a wake on the job's end);
        isa: force 'avx512bf16'|'avx512'|'avx2'|'scalar'."""
        ext = build_extension()
        cpus = physical_cpus()
        n = num_threads or len(cpus)
        if spin_us is None:
            spin_us = self.SPIN_US_SPARE_CORE if n < len(cpus) else self.SPIN_US_SHARED
        # pin only when there is a core per worker; oversubscribed pools (tests) float
        self._impl = ext.Executor(cpus if n <= len(cpus) else [], n, spin_us, isa)
        self.banks = banks
        self._pending: tuple | None = None
        self._no_flag = torch.empty(0, dtype=torch.int64)  # "no ready flag", made once (an allocation per call shows)
        self.last_ready_ns = 0  # steady-clock ns when the last job's inputs were available
        self.last_done_ns = 0
        self.last_experts = 0  # distinct experts the last job read (its bytes = this x expert_nbytes)
        self.last_routes = 0  # (token, expert) routes the last job computed

    @property
    def isa(self) -> str:
        return self._impl.isa

    @property
    def num_threads(self) -> int:
        return self._impl.num_threads

    @property
    def last_compute_seconds(self) -> float:
        """CPU time of the last job from inputs ready to output written (excludes waiting for the GPU)."""
        return max(0, self.last_done_ns - self.last_ready_ns) * 1e-9

    def submit(self, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layer: int = 0,
               out: torch.Tensor | None = None, ready: torch.Tensor | None = None, ready_value: int = 0) -> None:
        """Start layer ``layer``'s routes. hidden [T, D] fp32|bf16 · ids [T, A] int (< 0 skipped) ·
        weights [T, A] · out: optional fp32 [T, D] (e.g. a pinned buffer) · ready: optional pinned int64
        [1]; the workers start once ``ready[0] >= ready_value`` (written by the GPU stream after it copied
        the inputs down), so submit never blocks on the GPU. All tensors on the CPU."""
        if self._pending is not None:
            raise RuntimeError("cpu executor: submit() while a job is in flight; call wait() first")
        lb: LayerBanks = self.banks.layers[layer]
        gate_up, down = lb.tensors["gate_up"], lb.tensors["down"]
        if out is None:
            out = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=torch.float32)
        if not hidden.is_contiguous():
            hidden = hidden.contiguous()
        if ids.dtype not in (torch.int64, torch.int32) or not ids.is_contiguous():
            ids = ids.long().contiguous()
        if weights.dtype not in (torch.float32, torch.bfloat16) or not weights.is_contiguous():
            weights = weights.float().contiguous()
        if ready is None:
            ready = self._no_flag
        self._impl.submit(hidden, ids, weights, gate_up, down, out, ready, int(ready_value))
        self._pending = (hidden, ids, weights, out, ready)

    def wait(self) -> torch.Tensor:
        """Block until the submitted job is done; returns its ``out [T, D]`` fp32."""
        if self._pending is None:
            raise RuntimeError("cpu executor: wait() without a submitted job")
        out = self._pending[3]
        try:
            self.last_ready_ns, self.last_done_ns, self.last_experts, self.last_routes = self._impl.wait()
        finally:
            self._pending = None
        return out

    def start_loop(self, hidden: torch.Tensor, ids_table: torch.Tensor, weights: torch.Tensor, layer: int = 0) -> None:
        """Run jobs back to back on the workers until ``stop_loop()`` (no Python per job): job k computes
        ``ids_table[k % N]``. hidden [T, D] · ids_table [N, T, A] int64 · weights [T, A] fp32. For
        measuring what the executor sustains while something else (PCIe copies) competes for DRAM."""
        if self._pending is not None:
            raise RuntimeError("cpu executor: start_loop() while a job is in flight; call wait() first")
        lb: LayerBanks = self.banks.layers[layer]
        out = torch.empty((hidden.shape[0], hidden.shape[1]), dtype=torch.float32)
        args = (hidden.contiguous(), ids_table.long().contiguous(), weights.float().contiguous())
        self._impl.start_loop(*args, lb.tensors["gate_up"], lb.tensors["down"], out)
        self._pending = (*args, out, "loop")

    def loop_counters(self) -> tuple[int, int, int]:
        """(jobs done, expert bytes read, steady-clock ns now) of the running loop: two readings give
        the executor's rate over exactly the window between them."""
        return tuple(self._impl.loop_counters())

    def stop_loop(self) -> tuple[int, int, int]:
        """End the loop after its current job; returns the final ``loop_counters()``."""
        if self._pending is None or self._pending[-1] != "loop":
            raise RuntimeError("cpu executor: stop_loop() without start_loop()")
        try:
            return tuple(self._impl.stop_loop())
        finally:
            self._pending = None

    def read_bandwidth(self, nbytes: int = 1 << 30, reps: int = 5) -> float:
        """STREAM-style read ceiling of this pool (bytes/s): every worker sums its slice of an fp32
        buffer of ``nbytes`` with the widest loads it has (the `cpubw.c` probe's loop), best of ``reps``."""
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        seconds = self._impl.read_seconds(buf, reps)
        return buf.numel() * 4 / seconds

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Synchronous submit + wait."""
        self.submit(hidden, ids, weights, layer)
        return self.wait()

    def close(self) -> None:
        """Finish any job and stop the workers."""
        if self._pending is not None:
            self.stop_loop() if self._pending[-1] == "loop" else self.wait()
        self._impl = None


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
                                        [lb.tensors["gate_up"] for lb in layers], [lb.tensors["down"] for lb in layers])

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
                                     [lb.tensors["gate_up"] for lb in layers], [lb.tensors["down"] for lb in layers])

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.engine.moe.cpu_executor",
                                     description="Build the CPU MoE executor extension (the install step runs this).")
    parser.add_argument("--build", action="store_true", help="compile (or load the cached) extension and report the ISA")
    parser.add_argument("--verbose", action="store_true", help="show the compiler commands and output")
    args = parser.parse_args(argv)
    if not args.build:
        parser.print_help()
        return 0
    ext = build_extension(verbose=args.verbose)
    print(f"cpu executor extension: {extension_dir()} · isa {ext.select_isa('')} · "
          f"{len(physical_cpus())} physical cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())

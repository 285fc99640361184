"""The measurements of `tandem bench bw`. Each returns GB/s (1e9 B/s) or seconds.

Dimension legend: E experts per layer · A experts per token (top-k) · D hidden · I expert intermediate.

Two layers (benchmarks guide §5.2): ceilings (STREAM-style CPU read, linear pinned H2D/D2H) and the
real kernels per expert format (the CPU executor at batch 1, the PCIe gather through copy_missing),
then both kernels at once, competing for host DRAM — those concurrent numbers set the split.
Each measurement runs for about ``seconds`` of wall time after one warm-up call.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from services.common.logging import get_logger
from services.engine.moe.banks import (BANK_SCHEMAS, BIAS_BANKS, GGUF_TYPES, SCALE_BANKS, ExpertFormat, check_geometry, host_bank,
                                       pin_host)
from services.engine.moe.reference import ClampedSwiGLU

log = get_logger("profiler.probes")

GB = 1e9


def _loop(fn: Callable[[], int], seconds: float, stop: threading.Event | None = None) -> tuple[int, float]:
    """Call ``fn`` (returns bytes moved) until ``seconds`` pass (or ``stop`` is set): (bytes, elapsed s)."""
    fn()  # warm-up (first-touch, allocator, lazy init)
    moved, t0 = 0, time.perf_counter()
    while True:
        moved += fn()
        el = time.perf_counter() - t0
        if el >= seconds or (stop is not None and stop.is_set()):
            return moved, el


# ------------------------------------------------------------------------------------------------ CPU read

def cpu_read(buffer_bytes: int, cpus: list[int], seconds: float) -> float:
    """STREAM-style read: one thread per physical core (pinned to ``cpus``), each summing its own
    slice of a float32 buffer (numpy's sum releases the GIL). GB/s over all threads."""
    n = max(len(cpus), 1)
    per = max(buffer_bytes // 4 // n, 1024)
    data = np.ones(per * n, dtype=np.float32)  # [n * per], written once so pages are real
    chunks = [data[i * per:(i + 1) * per] for i in range(n)]
    barrier, totals = threading.Barrier(n), [0.0] * n

    def worker(i: int) -> None:
        if hasattr(os, "sched_setaffinity") and cpus:
            try:
                os.sched_setaffinity(0, {cpus[i]})  # pid 0 = this thread on Linux
            except OSError:
                pass
        chunk = chunks[i]
        chunk.sum()
        barrier.wait()
        moved, el = _loop(lambda: (chunk.sum(), chunk.nbytes)[1], seconds)
        totals[i] = moved / el

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(totals) / GB


# ------------------------------------------------------------------------------------------------ banks

# expert formats of a bf16 model (banks.ExpertFormat values besides unquantized): FP8, gpt-oss's MXFP4, and GGUF's
GGUF_FORMATS = tuple(f.value for f in GGUF_TYPES)  # q4_K, ..., q4_K+q6_K (a Q4_K_M file's layers), ...
QUANTIZED = ("fp8_block", "mxfp4", *GGUF_FORMATS)


@dataclass
class ExpertBank:
    """One layer's experts in host memory (pinned when a GPU is measured: the real banks are pinned), in
    format ``fmt`` (services/engine/moe/banks.py BANK_SCHEMAS): gate_up [E, 2I, D], down [E, D, I] (mxfp4:
    packed, [E, 2I, D/2], [E, D, I/2]); ``scales`` the quantized formats' scale banks (fp8_block:
    gate_up_scale [E, 2*ceil(I/128), ceil(D/128)], down_scale [E, ceil(D/128), ceil(I/128)]; mxfp4: E8M0
    bytes [E, 2I, D/32], [E, D, I/32]); ``biases`` gpt-oss's (gate_up_bias [E, 2I], down_bias [E, D]) and
    ``activation`` its clamped SwiGLU (mxfp4: what a gpt-oss expert is)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    scales: dict[str, torch.Tensor] = field(default_factory=dict)
    fmt: str = "unquantized"
    biases: dict[str, torch.Tensor] = field(default_factory=dict)
    activation: ClampedSwiGLU | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """Every bank by name, in the bank schema's order, biases last (what the cache copies and the executor
        reads)."""
        return {"gate_up": self.gate_up, "down": self.down, **self.scales, **self.biases}

    @property
    def act_dtype(self) -> torch.dtype:
        """The hidden states' dtype: the bank's, or bf16 for quantized experts (a bf16 model's)."""
        return torch.bfloat16 if self.fmt in QUANTIZED else self.gate_up.dtype

    @property
    def expert_bytes(self) -> int:
        return sum(t[0].nbytes for t in self.tensors.values())


def make_bank(E: int, D: int, I: int, dtype: torch.dtype, pin: bool, huge_pages: bool = True,
              fmt: str = "unquantized") -> ExpertBank:
    """A bank in the memory the engine's host banks live in (banks.host_bank: huge pages unless
    ``huge_pages`` is False, pinned in place). ``fmt`` "fp8_block": e4m3 codes (random, finite) with
    block scales; "mxfp4": gpt-oss's experts (random bytes with E8M0 scales tiled from a pool:
    random_banks.py, zero biases, the clamped SwiGLU; ValueError unless D and I are multiples of 32); a GGUF
    format ("q4_K", "q4_K+q6_K", ...): valid blocks repeated from a quantized pool (random_banks.fill_gguf_;
    ValueError unless D and I are whole blocks);
    ``dtype`` is used by "unquantized" only."""
    biases, activation = {}, None
    if fmt == "fp8_block":
        from services.engine.moe.fp8 import grid

        gate_up = host_bank((E, 2 * I, D), torch.float8_e4m3fn, huge_pages)  # [E, 2I, D]
        down = host_bank((E, D, I), torch.float8_e4m3fn, huge_pages)  # [E, D, I]
        for t in (gate_up, down):
            t.view(torch.uint8).random_(0, 0x7F)  # 0..0x7E: every finite positive code (0x7F is NaN)
        scales = {"gate_up_scale": host_bank((E, 2 * grid(I), grid(D)), torch.float32, huge_pages).fill_(1e-3),
                  "down_scale": host_bank((E, grid(D), grid(I)), torch.float32, huge_pages).fill_(1e-3)}
    elif fmt == "mxfp4":
        from services.profiler.random_banks import fill_mxfp4_

        check_geometry(ExpertFormat.MXFP4, D, I)
        t = {s.name: host_bank((E, *s.shape(D, I)), s.dtype or torch.bfloat16, huge_pages)
             for s in BANK_SCHEMAS[ExpertFormat.MXFP4] + BIAS_BANKS}
        fill_mxfp4_(t)
        gate_up, down = t.pop("gate_up"), t.pop("down")
        scales = {name: t.pop(name) for name in SCALE_BANKS[ExpertFormat.MXFP4]}
        biases, activation = t, ClampedSwiGLU()
    elif fmt in GGUF_FORMATS:
        from services.profiler.random_banks import fill_gguf_

        check_geometry(ExpertFormat(fmt), D, I)
        gate_up, down = (host_bank((E, *s.shape(D, I)), torch.uint8, huge_pages) for s in BANK_SCHEMAS[ExpertFormat(fmt)])
        fill_gguf_({"gate_up": gate_up, "down": down}, *GGUF_TYPES[ExpertFormat(fmt)])
        scales = {}
    elif fmt == "unquantized":
        gate_up = host_bank((E, 2 * I, D), dtype, huge_pages).normal_(0, 0.02)  # [E, 2I, D]
        down = host_bank((E, D, I), dtype, huge_pages).normal_(0, 0.02)  # [E, D, I]
        scales = {}
    else:
        raise ValueError(f"make_bank: unknown expert format {fmt!r} (unquantized, {', '.join(QUANTIZED)})")
    if pin:
        gate_up, down, *rest = pin_host([gate_up, down, *scales.values(), *biases.values()])
        scales = dict(zip(scales, rest[:len(scales)]))
        biases = dict(zip(biases, rest[len(scales):]))
    return ExpertBank(gate_up, down, scales, fmt, biases, activation)


def _rotating_ids(E: int, A: int):
    """Distinct expert ids per step, rotating through the whole bank so reads come from DRAM, not LLC."""
    step = 0
    while True:
        yield [(step * A + k) % E for k in range(A)]  # A consecutive ids: distinct while A <= E
        step += 1


# ------------------------------------------------------------------------------------------------ CPU kernel

class CpuKernel:
    """The CPU side of hybrid at batch 1: A experts of one layer for one token.

    impl "executor": the cpu helper's C++ executor (services/engine/moe/cpu_executor.py), the kernel
    hybrid really runs; "torch": per-expert torch GEMVs (no extension needed); "auto": the executor when
    it is in the tree and builds, else torch with a warning (the profile records which one ran)."""

    def __init__(self, bank: ExpertBank, top_k: int, threads: int, impl: str = "auto"):
        self.bank, self.A = bank, min(top_k, bank.num_experts)
        D = bank.down.shape[1]  # hidden size (gate_up packs two mxfp4 values a byte: its last dim is D/2)
        self.x = torch.randn(1, D, dtype=bank.act_dtype)  # [1, D]
        self.w = torch.full((1, self.A), 1.0 / self.A)  # [1, A]
        self.ids = _rotating_ids(bank.num_experts, self.A)
        self.executor = None
        if impl in ("auto", "executor") and have_module("services.engine.moe.cpu_executor"):
            try:
                from services.engine.moe.banks import ExpertBanks, LayerBanks
                from services.engine.moe.cpu_executor import CpuExecutor

                banks = ExpertBanks([LayerBanks(ExpertFormat(bank.fmt), bank.tensors)], bank.activation)
                self.executor = CpuExecutor(banks, num_threads=threads)
            except RuntimeError as ex:
                if impl == "executor":
                    raise
                log.warning("cpu executor unavailable, measuring torch GEMVs instead: %s", ex)
        elif impl == "executor":
            raise RuntimeError("--cpu-kernel executor: services/engine/moe/cpu_executor.py is not in the tree")
        if self.executor is None:
            torch.set_num_threads(threads)
        self.name = f"cpu_executor({self.executor.isa})" if self.executor else "torch"

    def _torch_step(self, ids: list[int]) -> None:
        from services.engine.moe.dequant import dense_experts
        from services.engine.moe.reference import expert_swiglu

        b, sc, bias = self.bank, self.bank.scales, self.bank.biases
        for e in ids:  # quantized: dequantized per expert (what the grouped torch loop does)
            gate_up, down = dense_experts(ExpertFormat(b.fmt), b.gate_up[e], b.down[e],
                                          sc["gate_up_scale"][e] if sc else None, sc["down_scale"][e] if sc else None,
                                          self.x.dtype)
            expert_swiglu(self.x, gate_up, down, b.activation, bias["gate_up_bias"][e] if bias else None,
                          bias["down_bias"][e] if bias else None)  # [1, D]

    def step(self) -> int:
        """One layer's A experts; returns expert bytes read."""
        ids = next(self.ids)
        if self.executor is not None:
            self.executor.forward(0, self.x, torch.tensor([ids], dtype=torch.int64), self.w)  # [1, D]
        else:
            self._torch_step(ids)
        return self.A * self.bank.expert_bytes

    def loop_table(self, rows: int = 64) -> torch.Tensor:
        """[rows, 1, A] int64: the next ``rows`` steps' ids (the executor's loop mode cycles through them)."""
        return torch.tensor([[next(self.ids)] for _ in range(rows)], dtype=torch.int64)

    def read_ceiling(self, buffer_bytes: int) -> float | None:
        """The executor pool's STREAM-style read (GB/s), or None without the executor."""
        return self.executor.read_bandwidth(buffer_bytes, reps=3) / GB if self.executor else None

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


def cpu_kernel_bw(kernel: CpuKernel, seconds: float, stop: threading.Event | None = None) -> float:
    """GB/s of the CPU kernel alone: the executor in loop mode (jobs back to back on its threads, no
    Python per job), else a Python loop of torch GEMVs."""
    if kernel.executor is not None and stop is None:
        ex = kernel.executor
        ex.start_loop(kernel.x, kernel.loop_table(), kernel.w)
        try:
            time.sleep(min(0.2, seconds / 4))  # warm-up: workers awake, pages touched
            jobs0, bytes0, ns0 = ex.loop_counters()
            time.sleep(seconds)
            jobs1, bytes1, ns1 = ex.loop_counters()
        finally:
            ex.stop_loop()
        return (bytes1 - bytes0) / ((ns1 - ns0) * 1e-9) / GB
    moved, el = _loop(kernel.step, seconds, stop)
    return moved / el / GB


# ------------------------------------------------------------------------------------------------ GPU side

def _cuda_timed(fn: Callable[[], int], seconds: float) -> float:
    """GB/s of ``fn`` (enqueues copies, returns bytes) timed with a sync per call."""
    def call() -> int:
        n = fn()
        torch.cuda.synchronize()
        return n
    moved, el = _loop(call, seconds)
    return moved / el / GB


def linear_copy(buffer_bytes: int, device: int, seconds: float) -> tuple[float, float]:
    """(H2D, D2H) GB/s of one linear pinned <-> device copy of ``buffer_bytes``."""
    host = torch.empty(buffer_bytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(buffer_bytes, dtype=torch.uint8, device=f"cuda:{device}")
    h2d = _cuda_timed(lambda: (dev.copy_(host, non_blocking=True), buffer_bytes)[1], seconds)
    d2h = _cuda_timed(lambda: (host.copy_(dev, non_blocking=True), buffer_bytes)[1], seconds)
    return h2d, d2h


class Gather:
    """The offload path's PCIe gather: A experts of one layer into GPU slots, every bank, through the
    cache helper's fused ``copy_missing`` (kernels/gather_copy.py, one launch) when it is in the tree,
    else one ``copy_`` per expert and bank (what benchmarks/ceilings.py measures)."""

    def __init__(self, bank: ExpertBank, top_k: int, device: int):
        self.bank, self.A = bank, min(top_k, bank.num_experts)
        dev = torch.device(f"cuda:{device}")
        self.slots = {name: torch.empty((self.A, *t.shape[1:]), dtype=t.dtype, device=dev)
                      for name, t in bank.tensors.items()}  # every bank (FP8: the scales too)
        self.ids = _rotating_ids(bank.num_experts, self.A)
        self.plan = None
        if have_module("kernels.gather_copy"):
            from kernels.gather_copy import CopyPlan

            self.plan = CopyPlan([bank.tensors], self.slots)
            E = bank.num_experts
            steps = max(1, E // self.A)
            table = [[(s * self.A + k) % E for k in range(self.A)] for s in range(steps)]
            self.job_src = torch.tensor(table, dtype=torch.int32, device=dev)  # [steps, A] flat ids (layer 0)
            self.job_dst = torch.arange(self.A, dtype=torch.int32, device=dev)  # [A] slots
            self.job_count = torch.tensor([self.A], dtype=torch.int32, device=dev)  # [1]
            self.step_no = 0
        self.name = "copy_missing(fused)" if self.plan is not None else "copy_"

    def issue(self) -> int:
        """Enqueue one layer's gather (no sync); returns bytes."""
        if self.plan is not None:
            from kernels.gather_copy import CopyMode, copy_missing

            src = self.job_src[self.step_no % self.job_src.shape[0]]
            self.step_no += 1
            copy_missing(self.plan, src, self.job_dst, self.job_count, mode=CopyMode.FUSED, max_jobs=self.A)
        else:
            for s, e in enumerate(next(self.ids)):
                for name, t in self.bank.tensors.items():
                    self.slots[name][s].copy_(t[e], non_blocking=True)
        return self.A * self.bank.expert_bytes


def gather_bw(gather: Gather, seconds: float) -> float:
    return _cuda_timed(gather.issue, seconds)


def concurrent(kernel: CpuKernel, gather: Gather, seconds: float) -> tuple[float, float]:
    """(pcie_ov, cpu_ov) GB/s, both over the same wall-clock window: the executor runs jobs back to back
    on its own threads (loop mode, like a C GEMV looping on every core) while this thread gathers
    in a loop; the CPU's rate is the expert bytes its jobs read between the window's two counter
    readings. This thread only enqueues copies and waits on the GPU: give the executor one core less
    than the host has (bench_bw does), or the two fight over a core. Without the executor, the torch
    kernel loops in a Python thread (GIL-bound: a lower bound)."""
    if kernel.executor is None:
        return _concurrent_threaded(kernel, gather, seconds)
    ex = kernel.executor
    gather.issue()
    torch.cuda.synchronize()
    ex.start_loop(kernel.x, kernel.loop_table(), kernel.w)
    try:
        time.sleep(0.1)  # workers awake and streaming before the window opens
        _, bytes0, ns0 = ex.loop_counters()
        copied, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            copied += gather.issue()
            torch.cuda.synchronize()
        el = time.perf_counter() - t0
        _, bytes1, ns1 = ex.loop_counters()
    finally:
        ex.stop_loop()
    return copied / el / GB, (bytes1 - bytes0) / ((ns1 - ns0) * 1e-9) / GB


def _concurrent_threaded(kernel: CpuKernel, gather: Gather, seconds: float) -> tuple[float, float]:
    stop, started, result = threading.Event(), threading.Event(), [0.0]

    def cpu_side() -> None:
        kernel.step()
        started.set()
        result[0] = cpu_kernel_bw(kernel, 1e9, stop)

    t = threading.Thread(target=cpu_side, daemon=True)
    t.start()
    started.wait()
    try:
        pcie = gather_bw(gather, seconds)
    finally:
        stop.set()
        t.join()
    return pcie, result[0]


# ------------------------------------------------------------------------------------------------ c_sync

def _median_seconds(fn: Callable[[], None], seconds: float, min_samples: int = 50) -> float:
    for _ in range(20):
        fn()
    samples, t_end = [], time.perf_counter() + seconds
    while time.perf_counter() < t_end or len(samples) < min_samples:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def c_sync(kernel: CpuKernel, hidden: int, device: int | None, seconds: float) -> float:
    """Seconds per layer the hybrid path pays to hand work to the CPU and get it back, with no work
    (all ids -1): with the executor on a GPU, the eager handoff's fixed cost inside a layer loop
    (handoff_cost.measure_c_sync_eager: loop with the handoff minus loop without,
    so the GPU's own latency hidden by the pipeline is not counted); with the executor alone, submit +
    wait; else a Python thread round trip (+ small D2H/H2D on a GPU, as benchmarks/ceilings.py's handoff_us)."""
    dtype, A = kernel.bank.act_dtype, kernel.A
    if kernel.executor is not None and device is not None:
        from services.profiler.handoff_cost import measure_c_sync_eager

        with torch.cuda.device(device):
            res = measure_c_sync_eager(kernel.executor, hidden, A, dtype, fast=True, reps=max(5, int(seconds * 20)))
        log.info("c_sync %.1f us per layer (eager handoff, %s; layer %.1f us with, %.1f us without)",
                 res["c_sync_s"] * 1e6, "driver path" if res["fast_path"] else "torch path",
                 res["layer_with_handoff_s"] * 1e6, res["layer_gpu_only_s"] * 1e6)
        return max(res["c_sync_s"], 1e-6)  # a difference of two timings: never report a free handoff
    if kernel.executor is not None:
        x, ids, w = torch.randn(1, hidden, dtype=dtype), torch.full((1, A), -1, dtype=torch.int64), torch.zeros(1, A)
        return _median_seconds(lambda: kernel.executor.forward(0, x, ids, w), seconds)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    done: queue.SimpleQueue = queue.SimpleQueue()

    def worker() -> None:
        while (job := jobs.get()) is not None:
            done.put(job)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    if device is not None:
        xd = torch.randn(1, hidden, dtype=dtype, device=f"cuda:{device}")  # [1, D]
        xh, yh = torch.empty(1, hidden, dtype=dtype).pin_memory(), torch.empty(1, hidden, dtype=dtype).pin_memory()
        yd = torch.empty_like(xd)

    def roundtrip_py() -> None:
        if device is not None:
            xh.copy_(xd, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
        jobs.put(1)
        done.get()
        if device is not None:
            yd.copy_(yh, non_blocking=True)
            torch.cuda.current_stream(device).synchronize()
    try:
        return _median_seconds(roundtrip_py, seconds)
    finally:
        jobs.put(None)
        t.join()


def have_module(name: str) -> bool:
    """Whether another helper's module is in the tree (its absence is a fallback, not an error)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# ------------------------------------------------------------------------------------------------ P2P

def p2p_links(devices: list[torch.device], buffer_bytes: int) -> list[tuple[int, int, float]]:
    """(src, dst, GB/s) of one linear device-to-device copy for every ordered pair of ``devices`` (indices
    into the list): the peer tier's fetch path (docs/multi-gpu.md). One device has no pair: []. A device
    listed twice measures a copy within it (a simulated pair, as the engine's simulated peers)."""
    from services.engine.moe.peer_cache import measure_copy_gbps

    return [(i, j, measure_copy_gbps(src, dst, buffer_bytes))
            for i, src in enumerate(devices) for j, dst in enumerate(devices) if i != j]

"""CPU MoE executor: computes routed experts on the CPU, reading the host banks in place.

Dimension legend: T tokens · A routes per token · E experts · D hidden · I expert intermediate.

The work runs in a C++ extension (``csrc/``): a persistent pool of worker threads, one per physical core
and pinned, that splits the rows of each expert's gate_up and down GEMVs across cores (at bs=1 the
parallelism is *inside* the expert GEMVs) with AVX-512-BF16 / AVX-512 / AVX2 / scalar kernels picked at
run time. Plain per-expert torch calls reach ~60 of 103 GB/s DRAM read on the H200 host (docs/design.md §6);
the decode GEMV is bandwidth-bound, so that gap is the reason for the extension.

The extension is compiled from source once per (Python, torch) pair into a cache directory
(``TANDEM_EXT_DIR``). The install step builds it ahead of time::

    .venv/bin/python -m services.engine.moe.cpu_executor --build

There is deliberately no pure-torch fallback: a build failure raises with the compiler's reason.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from pathlib import Path

import torch

from services.common.logging import get_logger
from services.common.settings import env
from services.engine.moe.banks import ExpertBanks, LayerBanks
from services.engine.moe.gguf_quant import KERNEL_CODE, format_types, q8_inputs

log = get_logger("engine.cpu_executor")

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("executor.cpp", "gemv.cpp", "gguf_gemv.cpp")
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
        # torch's build lock is a plain `lock` file: a build killed midway (Ctrl-C during the first start)
        # leaves it, and every later start waits on it forever. An flock is released by the OS when its
        # holder dies, so whoever holds ours knows a `lock` file left beside it belongs to no live build.
        with open(build_dir / "tandem-build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            baton = build_dir / "lock"
            if baton.exists():
                log.warning("cpu executor: removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
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
    _EXTENSION.set_stream_prefetch(*stream_prefetch(STREAM_PREFETCH))
    log.info("cpu executor extension ready (%s, %.1f s, isa %s, stream prefetch %s)", build_dir,
             time.perf_counter() - t0, _EXTENSION.select_isa(""), STREAM_PREFETCH)
    return _EXTENSION


PREFETCH_LEVELS = {"l1": 0, "l2": 1, "nta": 2}
# The executor's software prefetch into its weight stream: 4 KiB ahead into L2. On the H200 host it streamed
# 110.9 GB/s beside the PCIe copy with 2 MiB pages, against 90.3 before (prefetcht0 holds one of ~16 L1
# fill buffers per line in flight, prefetcht1 only an entry of L2's deeper queue); `bench_cpu_stream
# --prefetch` compares other settings.
STREAM_PREFETCH = "4096:l2"


def stream_prefetch(setting: str) -> tuple[int, int]:
    """'BYTES:LEVEL' (or '0' = off) -> (bytes, level) for the extension's ``set_stream_prefetch``."""
    text = setting.strip().lower()
    if text in ("0", "off"):
        return 0, -1
    nbytes, _, level = text.partition(":")
    if not nbytes.isdigit() or int(nbytes) % 64 or level not in PREFETCH_LEVELS:
        raise ValueError(f"stream prefetch {setting!r}: expected BYTES:LEVEL with BYTES a multiple of 64 "
                         f"and LEVEL one of {', '.join(PREFETCH_LEVELS)} (for example 4096:l2), or 0 for off")
    return int(nbytes), PREFETCH_LEVELS[level]


_confined_from: set[int] | None = None  # the process's CPUs before confine_other_threads(), while confined


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on (as before confine_other_threads(), while that is in force)."""
    return set(_confined_from) if _confined_from is not None else os.sched_getaffinity(0)


def _set_every_thread(cpus: set[int]) -> None:
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def confine_other_threads(worker_cpus: list[int]) -> set[int]:
    """Move every thread of this process onto the CPUs no worker is pinned to, before the workers start
    (threads made later inherit their maker's CPUs; the workers then pin themselves). The CPUs given,
    or an empty set when none are left over or a confinement is already in force.

    Why: a thread that floats (the engine's model thread, the HTTP event loop streaming tokens while the
    next step runs) is woken wherever the kernel likes, often on a worker's core; that worker's share of
    a layer then waits out the time slice, and the whole layer with it."""
    global _confined_from
    allowed = allowed_cpus()
    spare = allowed - set(worker_cpus)
    if not spare or _confined_from is not None:
        return set()
    _set_every_thread(spare)
    _confined_from = allowed
    return spare


def release_other_threads() -> None:
    """Undo confine_other_threads() (after the workers have stopped): every thread may use every CPU again."""
    global _confined_from
    if _confined_from is not None:
        _set_every_thread(_confined_from)
        _confined_from = None


WORKER_NAME_PREFIX = "tandem-cpu-"  # executor.cpp names its worker threads so (top -H, /proc)


def _worker_tids() -> set[int]:
    """Thread ids of this process's executor workers (all pools)."""
    tids = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            if (task / "comm").read_text().startswith(WORKER_NAME_PREFIX):
                tids.add(int(task.name))
        except OSError:  # the thread ended meanwhile
            continue
    return tids


def _preemptions(tid: int) -> int:
    """Nonvoluntary context switches of one thread of this process (0 once it has ended)."""
    try:
        for line in Path(f"/proc/self/task/{tid}/status").read_text().splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def physical_cpus() -> list[int]:
    """One logical CPU per physical core among those this process may run on (SMT siblings dropped:
    two threads streaming DRAM from one core share its load ports and gain nothing)."""
    allowed = sorted(allowed_cpus())
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
    read in place (bf16, fp32, fp8_block: e4m3 weights widened in registers, one fp32 scale per 128x128
    block applied to each block's partial sum, or mxfp4: e2m1 nibbles decoded through a table, one E8M0
    scale per 32 values, or GGUF blocks (q4_K, q5_K, q6_K, q8_0, mxfp4_gguf: uint8 banks without scale
    banks, each bank's type told by its row bytes, gate_up and down may differ), each block decoded once
    per row pass; biases and the clamped SwiGLU for gpt-oss). One job in flight at a time.
    """

    SPIN_US_SPARE_CORE = 5000  # a decode layer's gap between CPU jobs is ~0.1-1 ms: spin through it
    SPIN_US_SHARED = 200  # every core has a worker: the caller needs the cores back soon

    def __init__(self, banks: ExpertBanks, num_threads: int | None = None, spin_us: int | None = None, isa: str = "",
                 confine_others: bool = False):
        """num_threads: workers (default one per physical core, each pinned to its core); spin_us: how
        long idle workers and wait() spin before sleeping (default: 5 ms when a core is left for the
        caller, else 200 us: a sleeping pool costs a futex wake of every worker, serialised on one
        mutex, on the next job; a sleeping wait() a wake on the job's end);
        isa: force 'avx512bf16'|'avx512'|'avx2'|'scalar'; confine_others: keep the process's other
        threads on the CPUs left over from the workers until close() (confine_other_threads)."""
        ext = build_extension()
        cpus = physical_cpus()
        n = num_threads or len(cpus)
        if spin_us is None:
            spin_us = self.SPIN_US_SPARE_CORE if n < len(cpus) else self.SPIN_US_SHARED
        # pinned one per core when there is a core per worker; oversubscribed pools (tests) float (empty)
        self.worker_cpus = cpus[:n] if n <= len(cpus) else []
        self.confined_to = confine_other_threads(self.worker_cpus) if confine_others and n < len(cpus) else set()
        if self.confined_to:
            log.info("cpu executor: %d workers on cores %s; the process's other threads on CPUs %s", n,
                     self.worker_cpus, sorted(self.confined_to))
        others = _worker_tids()
        self._impl = ext.Executor(self.worker_cpus, n, spin_us, isa)
        self._tids = _worker_tids() - others  # this pool's workers (named before the constructor returns)
        self.banks = banks
        gguf = [(lb.tensors["gate_up"], format_types(lb.format)) for lb in banks.layers]
        gguf = [(gu, types) for gu, types in gguf if types is not None]
        if gguf:  # GGUF layers: the types of gate_up and down per layer (rows may be padded: never guessed)
            self._impl.set_gguf_layers([gu for gu, _ in gguf], [KERNEL_CODE[t[0]] for _, t in gguf],
                                       [KERNEL_CODE[t[1]] for _, t in gguf])
        if not banks.plain_swiglu:  # gpt-oss: expert biases and the clamped SwiGLU, set once per layer bank
            act = banks.activation
            self._impl.set_expert_math([lb.tensors["gate_up"] for lb in banks.layers],
                                       [lb.tensors["gate_up_bias"] for lb in banks.layers],
                                       [lb.tensors["down_bias"] for lb in banks.layers], act.alpha, act.limit)
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
    def fp8_bf16_inputs(self) -> bool:
        """Whether fp8_block banks run the vdpbf16ps kernel when hidden states come in bf16 (the SwiGLU
        output then rounds to bf16 between gate_up and down, as in a bf16 model's GPU path); fp32
        hidden states always take the exact fp32-input kernel."""
        return self._impl.fp8_bf16_inputs

    @property
    def gguf_q8_inputs(self) -> bool:
        """Whether GGUF banks (every type) run an int8-input kernel when hidden states come in bf16 (every ISA
        but scalar: AVX512-VNNI's vpdpbusd, else AVX2's vpmaddubsw): inputs quantized to int8 per 256 values
        (gguf_quant.q8_inputs) meet the blocks' integer quants. fp32 hidden states take the fp32-input kernel."""
        return self._impl.gguf_q8_inputs

    def input_rounding(self, fmt: str, dtype: torch.dtype):
        """What the GEMVs of a layer of format ``fmt`` do to their inputs when hidden states come in ``dtype``:
        gguf_quant.q8_inputs where the int8-input kernel runs (the reference then sees the same inputs), else
        None (fp32 inputs)."""
        gguf = format_types(fmt) is not None
        return q8_inputs if gguf and dtype == torch.bfloat16 and self.gguf_q8_inputs else None

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
        self._impl.submit(hidden, ids, weights, lb.ordered(), out, ready, int(ready_value))
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
        self._impl.start_loop(*args, lb.ordered(), out)
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

    def worker_preemptions(self) -> int:
        """How often the kernel took a core from one of the workers (their nonvoluntary context switches).
        A worker spins on its own core, so each one means another thread ran there and that worker's
        share of a layer waited: the count over a request says whether something (a client, a gateway,
        a noisy neighbour) shares the workers' cores."""
        return sum(_preemptions(tid) for tid in self._tids)

    def forward(self, layer: int, hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Synchronous submit + wait."""
        self.submit(hidden, ids, weights, layer)
        return self.wait()

    def close(self) -> None:
        """Finish any job and stop the workers."""
        if self._pending is not None:
            self.stop_loop() if self._pending[-1] == "loop" else self.wait()
        self._impl = None  # joins the workers
        if self.confined_to:
            release_other_threads()
            self.confined_to = set()


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

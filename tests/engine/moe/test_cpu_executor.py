"""CPU MoE executor (C++ extension) against the pure-torch moe_reference.

Shapes: T=1 (decode), odd sizes (D=33, I=17: vector tails), a batch with repeated experts, and every ISA
this CPU supports (the dispatcher's pick plus each forced kernel). The extension is built from source
on first use (cached); a build failure fails these tests with the compiler's reason.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # the graph handoff's kernels run interpreted here (tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.engine.moe.banks import ExpertBanks, ExpertFormat  # noqa: E402
from services.engine.moe.cpu_executor import CpuExecutor, build_extension, physical_cpus  # noqa: E402
from services.engine.moe.cpu_handoff import DeviceHandoff, GraphHandoff  # noqa: E402
from services.engine.moe.reference import moe_reference  # noqa: E402
from tests.helpers import CPU_PLAYS_THE_DEVICE, tolerance  # noqa: E402

SHAPES = [  # T, A, E, D, I
    (1, 1, 1, 16, 8),
    (1, 8, 32, 64, 48),
    (3, 2, 5, 33, 17),
    (17, 4, 9, 96, 40),
    (64, 8, 16, 128, 64),
]
ISAS = [isa for isa in ("avx512bf16", "avx512", "avx2", "scalar") if build_extension().select_isa(isa)]


def make_case(T, A, E, D, I, dtype, seed=0, drop=0.25):
    """Random banks (1 layer), hidden, distinct top-A ids per token with ~`drop` of them set to -1."""
    g = torch.Generator().manual_seed(seed)
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, 1, E, D, I, dtype)
    for t in banks.layers[0].tensors.values():
        t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    hidden = torch.randn(T, D, generator=g).to(dtype)  # [T, D]
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])  # [T, A]
    ids[torch.rand(T, A, generator=g) < drop] = -1
    weights = torch.rand(T, A, generator=g)  # [T, A]
    return banks, hidden, ids, weights


def reference(banks, hidden, ids, weights):
    """moe_reference in fp32 on the exact (bf16-representable) values: the math the executor must
    reproduce; the native-bf16 reference rounds every intermediate and is the noisier of the two."""
    L = banks.layers[0].tensors
    return moe_reference(hidden.float(), ids, weights, L["gate_up"].float(), L["down"].float())


@pytest.fixture(scope="module")
def executors():
    cache: dict = {}

    def get(banks, isa="", threads=3):
        ex = cache.get((isa, threads))
        if ex is None:
            ex = cache[(isa, threads)] = CpuExecutor(banks, num_threads=threads, spin_us=50, isa=isa)
        ex.banks = banks
        return ex
    yield get
    for ex in cache.values():
        ex.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}A{}E{}D{}I{}".format(*s))
def test_matches_reference(executors, shape, dtype):
    banks, hidden, ids, weights = make_case(*shape, dtype)
    ex = executors(banks)
    out = ex.forward(0, hidden, ids, weights)
    assert out.dtype == torch.float32 and out.shape == hidden.shape
    ref = reference(banks, hidden, ids, weights)
    torch.testing.assert_close(out, ref, atol=tolerance(dtype), rtol=tolerance(dtype))
    # every valid route computed exactly once, every distinct expert read once
    assert ex.last_routes == int((ids >= 0).sum())
    assert ex.last_experts == len(set(ids[ids >= 0].tolist()))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_isa(executors, isa, dtype):
    banks, hidden, ids, weights = make_case(5, 3, 7, 33, 17, dtype, seed=1)
    ex = executors(banks, isa=isa)
    assert ex.isa == isa
    torch.testing.assert_close(ex.forward(0, hidden, ids, weights), reference(banks, hidden, ids, weights),
                               atol=tolerance(dtype), rtol=tolerance(dtype))


def test_fp32_is_tight(executors):
    """fp32 banks: no bf16 rounding anywhere, so the match is to fp32 accumulation-order noise."""
    banks, hidden, ids, weights = make_case(4, 4, 8, 256, 96, torch.float32, seed=2)
    out = executors(banks).forward(0, hidden, ids, weights)
    torch.testing.assert_close(out, reference(banks, hidden, ids, weights), atol=1e-5, rtol=1e-5)


def test_many_threads_and_reuse(executors):
    """More workers than cores and than rows in some phases; the same pool reused for many jobs."""
    for seed in range(6):
        banks, hidden, ids, weights = make_case(2 + seed, 4, 6, 40, 24, torch.float32, seed=seed)
        out = executors(banks, threads=7).forward(0, hidden, ids, weights)
        torch.testing.assert_close(out, reference(banks, hidden, ids, weights), atol=1e-4, rtol=1e-4)


def test_skipped_routes_give_zeros(executors):
    banks, hidden, ids, weights = make_case(3, 2, 4, 32, 16, torch.float32)
    ids[:] = -1
    out = executors(banks).forward(0, hidden, ids, weights)
    assert torch.equal(out, torch.zeros_like(out)) and executors(banks).last_routes == 0


def test_async_api_contract(executors):
    banks, hidden, ids, weights = make_case(2, 2, 4, 32, 16, torch.float32)
    ex = executors(banks)
    ex.submit(hidden, ids, weights)
    with pytest.raises(RuntimeError, match="in flight"):
        ex.submit(hidden, ids, weights)
    out = ex.wait()
    torch.testing.assert_close(out, reference(banks, hidden, ids, weights), atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="without a submitted job"):
        ex.wait()


def test_ready_flag_gates_the_job(executors):
    """Workers must not start before the ready flag reaches the job's value (the GPU stream's signal)."""
    banks, hidden, ids, weights = make_case(2, 2, 4, 32, 16, torch.float32)
    ex = executors(banks)
    flag = torch.zeros(1, dtype=torch.int64)
    hidden_buf = torch.zeros_like(hidden)  # filled only after submit: a job that started early reads zeros
    ex.submit(hidden_buf, ids, weights, ready=flag, ready_value=7)
    hidden_buf.copy_(hidden)
    flag[0] = 7
    torch.testing.assert_close(ex.wait(), reference(banks, hidden, ids, weights), atol=1e-4, rtol=1e-4)


def test_bad_expert_id_names_the_problem(executors):
    banks, hidden, ids, weights = make_case(2, 2, 4, 32, 16, torch.float32)
    ids[1, 1] = 99
    ex = executors(banks)
    with pytest.raises(RuntimeError, match="expert id 99 out of range"):
        ex.forward(0, hidden, ids, weights)
    ids[1, 1] = 0  # the pool keeps working after an error
    ex.forward(0, hidden, ids, weights)


def test_physical_cpus_are_allowed_and_distinct():
    import os
    cpus = physical_cpus()
    assert cpus and len(set(cpus)) == len(cpus) and set(cpus) <= os.sched_getaffinity(0)


def test_confine_others_keeps_the_process_off_the_workers_cores():
    """With a core left over, every other thread of the process (those alive before, the caller, those
    made later) runs on the leftover CPUs while the executor lives, and everywhere again after close()."""
    import threading

    before = os.sched_getaffinity(0)
    cpus = physical_cpus()
    stop = threading.Event()
    older = threading.Thread(target=stop.wait)
    older.start()
    banks, hidden, ids, weights = make_case(3, 2, 5, 33, 17, torch.float32)
    ex = CpuExecutor(banks, num_threads=1, spin_us=50, confine_others=True)
    try:
        if len(cpus) < 2:  # no core to spare: nothing is confined
            assert ex.confined_to == set() and os.sched_getaffinity(0) == before
            return
        assert ex.confined_to == before - {cpus[0]}  # the one worker's core is the first physical one
        newer = threading.Thread(target=stop.wait)
        newer.start()
        for tid in (threading.get_native_id(), older.native_id, newer.native_id):
            assert os.sched_getaffinity(tid) == ex.confined_to
        assert physical_cpus() == cpus  # what the process may use is unchanged: a later pool sees every core
        torch.testing.assert_close(ex.forward(0, hidden, ids, weights), reference(banks, hidden, ids, weights))
    finally:
        ex.close()
        stop.set()
    assert os.sched_getaffinity(0) == before and os.sched_getaffinity(older.native_id) == before
    older.join()
    newer.join()


def test_worker_preemptions_count_a_thread_sharing_a_workers_core():
    """A pool finds its workers (named threads); a busy thread pinned to the one worker's core takes that
    core from the spinning worker now and then, and worker_preemptions() counts it."""
    import threading

    from services.engine.moe.cpu_executor import WORKER_NAME_PREFIX

    banks, hidden, ids, weights = make_case(3, 2, 5, 33, 17, torch.float32)
    ex = CpuExecutor(banks, num_threads=1, spin_us=2_000_000)  # idle spin for 2 s: it keeps its core busy
    try:
        assert ex.worker_cpus == physical_cpus()[:1] and len(ex._tids) == 1
        (tid,) = ex._tids
        assert Path(f"/proc/self/task/{tid}/comm").read_text().strip() == WORKER_NAME_PREFIX + "0"
        torch.testing.assert_close(ex.forward(0, hidden, ids, weights), reference(banks, hidden, ids, weights))
        before = ex.worker_preemptions()

        def busy() -> None:
            os.sched_setaffinity(0, set(ex.worker_cpus))
            end = time.monotonic() + 0.5
            while time.monotonic() < end:
                pass

        thread = threading.Thread(target=busy)
        thread.start()
        thread.join()
        assert ex.worker_preemptions() > before
    finally:
        ex.close()


def test_loop_mode_counts_every_job(executors):
    """start_loop runs jobs back to back (row k % N of the ids table) until stop_loop; the counters add
    up the distinct experts each job read, and the pool takes ordinary jobs again afterwards."""
    banks, hidden, ids, weights = make_case(2, 2, 6, 32, 16, torch.float32, drop=0.0)
    table = torch.tensor([[[0, 1], [1, 2]], [[3, 3 - 1], [-1, -1]], [[5, -1], [5, 4]]])  # [N=3, T=2, A=2]
    experts = [3, 2, 2]  # distinct ids >= 0 per row
    ex = executors(banks)
    ex.start_loop(hidden, table, weights)
    with pytest.raises(RuntimeError, match="in flight"):
        ex.submit(hidden, ids, weights)
    jobs0, _, t0 = ex.loop_counters()
    while ex.loop_counters()[0] < 7:
        pass
    jobs, nbytes, t1 = ex.stop_loop()
    assert jobs >= 7 and t1 > t0 and jobs >= jobs0
    assert nbytes == sum(experts[k % 3] for k in range(jobs)) * banks.expert_nbytes()
    torch.testing.assert_close(ex.forward(0, hidden, ids, weights), reference(banks, hidden, ids, weights),
                               atol=1e-4, rtol=1e-4)


def test_polling_starts_and_stops_cleanly(executors):
    """Graph mode runs on worker 0 (no poller thread): switching it on and off leaves the pool usable."""
    banks, hidden, ids, weights = make_case(1, 2, 4, 32, 16, torch.float32)
    ex = CpuExecutor(banks, num_threads=2, spin_us=0)  # workers asleep: worker 0 must wake to poll
    for _ in range(2):
        hand = GraphHandoff(ex, torch.device("cpu"), 1, 32, 2, torch.float32)
        hand.close()
        torch.testing.assert_close(ex.forward(0, hidden, ids, weights), reference(banks, hidden, ids, weights),
                                   atol=1e-4, rtol=1e-4)
    ex.close()


@pytest.mark.gpu
@pytest.mark.parametrize("fast", [True, False])
def test_device_handoff_matches_reference(executors, fast):
    """Both handoffs (driver-API fast path, torch copies) over several layers, token counts and a
    buffer growth; the fast path must really be in use where asked for."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    banks, _, _, _ = make_case(6, 4, 8, 64, 32, torch.bfloat16)
    for t in banks.layers[0].tensors.values():
        t.data = t.pin_memory()
    hand = DeviceHandoff(executors(banks), dev, 2, 64, 4, torch.bfloat16, fast=fast)  # grows to T=6
    assert hand.fast == fast
    for seed, T in enumerate([1, 2, 6, 3, 1, 6] * 12):  # > RING jobs: the flag values wrap
        _, hidden, ids, weights = make_case(T, 4, 8, 64, 32, torch.bfloat16, seed=seed)
        hand.submit(0, hidden.to(dev), ids.to(dev), weights.to(dev))
        out = hand.sync().clone()  # the fast path's buffer is reused by the next sync
        torch.testing.assert_close(out.cpu(), reference(banks, hidden, ids, weights), atol=2e-2, rtol=2e-2)


@CPU_PLAYS_THE_DEVICE
@pytest.mark.parametrize("wait_block", [4096, 32], ids=["one-program", "programs-per-block"])
def test_graph_handoff_protocol(executors, wait_block, monkeypatch):
    """Job word -> poller -> done word -> add, on the CPU (the kernels interpreted, the stream's order
    played by the test: the interpreter copies arguments, so the wait kernel runs once the CPU is done).
    wait_block 32: the wait kernel's output split over up to 5 programs, each waiting for the word."""
    import kernels.cpu_handoff

    monkeypatch.setattr(kernels.cpu_handoff, "WAIT_BLOCK", wait_block)
    L, E, D, I, A = 3, 6, 40, 24, 2
    g = torch.Generator().manual_seed(3)
    banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, L, E, D, I, torch.float32)
    for lb in banks.layers:
        for t in lb.tensors.values():
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
    ex = CpuExecutor(banks, num_threads=2, spin_us=50)
    hand = GraphHandoff(ex, torch.device("cpu"), 4, D, A, torch.float32)
    try:
        for step in range(4):
            layer, T = step % L, 1 + step % 4
            hidden = torch.randn(T, D, generator=g)
            ids = torch.randint(-1, E, (T, A), generator=g)
            w = torch.rand(T, A, generator=g)
            part = torch.randn(T, D, generator=g)
            hand.submit(layer, hidden, ids, w)
            while int(hand.done_h[0]) < step + 1:  # the GPU's wait kernel, played by the host
                pass
            misses, fetched = torch.arange(L) * 10 + step, torch.arange(L) + step  # a cache's counters [L]
            out = hand.sync_add(layer, part, (misses, fetched))
            L_ = banks.layers[layer].tensors
            want = part + moe_reference(hidden, ids, w, L_["gate_up"], L_["down"])
            torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
            assert hand.counters[layer].tolist() == [int(misses[layer]), int(fetched[layer])]  # mirrored
        stats = hand.poll_stats()
        assert stats["jobs"] == 4 and stats["error"] == "" and stats["last_seq"] == 4
        with pytest.raises(RuntimeError, match="polling"):
            ex.submit(hidden, ids, w)
    finally:
        hand.close()
    ex.forward(0, hidden, ids, w)  # direct jobs work again once polling stopped
    ex.close()


@CPU_PLAYS_THE_DEVICE
def test_graph_handoff_times_out_into_nans():
    """A CPU job that never answers must not hang the device: the wait kernel gives up and writes NaNs."""
    from kernels.cpu_handoff import wait_cpu_add

    seq = torch.ones(1, dtype=torch.int64)
    done = torch.zeros(1, dtype=torch.int64)
    out = wait_cpu_add(seq, done, torch.zeros(2, 8), torch.ones(2, 8), 0, max_polls=5)
    assert out.isnan().all()


def test_build_failure_names_the_cause(tmp_path, monkeypatch):
    """No silent fallback: a source that does not compile raises with the sources, the build dir and the
    compiler's message."""
    import services.engine.moe.cpu_executor as mod

    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setattr(mod, "_EXTENSION", None)
    monkeypatch.setattr(mod, "_CSRC", tmp_path)
    monkeypatch.setattr(mod, "_SOURCES", ("broken.cpp",))
    monkeypatch.setattr(mod, "extension_dir", lambda: tmp_path / "build")
    with pytest.raises(RuntimeError, match=r"building the C\+\+ extension from .*broken\.cpp in .*build failed") as err:
        mod.build_extension()
    assert "broken.cpp" in str(err.value) and "Error" in str(err.value)



@pytest.mark.timeout(120)
def test_a_lock_left_by_a_killed_build_does_not_hang_the_next(tmp_path, monkeypatch):
    """torch's build baton (a plain `lock` file) left by a build killed midway made every later start wait
    forever; the next build now removes it and goes on (here to the compiler's error, quickly)."""
    import services.engine.moe.cpu_executor as mod

    (tmp_path / "broken.cpp").write_text("this is not C++;\n")
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "lock").write_text("")  # what a killed build leaves
    monkeypatch.setattr(mod, "_EXTENSION", None)
    monkeypatch.setattr(mod, "_CSRC", tmp_path)
    monkeypatch.setattr(mod, "_SOURCES", ("broken.cpp",))
    monkeypatch.setattr(mod, "extension_dir", lambda: tmp_path / "build")
    with pytest.raises(RuntimeError, match="broken.cpp"):
        mod.build_extension()
    assert not (tmp_path / "build" / "lock").exists()

_FAKE_DRIVER_SCRIPT = r"""
import ctypes, sys
import torch
lib = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)  # soname libcuda.so.1: what the executor dlopens
from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.cpu_executor import CpuExecutor
from services.engine.moe.reference import moe_reference
L, E, D, I, A, CAP = 2, 6, 40, 24, 2, 4
g = torch.Generator().manual_seed(5)
banks = ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, L, E, D, I, torch.float32)
for lb in banks.layers:
    for t in lb.tensors.values():
        t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
ex = CpuExecutor(banks, num_threads=2, spin_us=50)
bufs = [torch.zeros(CAP, D), torch.zeros(CAP, A, dtype=torch.int64), torch.zeros(CAP, A), torch.zeros(CAP, D),
        torch.zeros(1, dtype=torch.int64)]
ring = torch.arange(1, 4, dtype=torch.int64)  # 3 flag values: wraps within the run
ex._impl.link_device(*bufs, ring.data_ptr(), 3, [lb.ordered() for lb in banks.layers])
keep = []
for step in range(12):
    layer, T = step % L, 1 + step % CAP
    hidden, ids = torch.randn(T, D, generator=g), torch.randint(-1, E, (T, A), generator=g)
    w = torch.rand(T, A, generator=g)
    out_d = torch.full((CAP, D), float("nan"))
    keep.append((hidden, ids, w, out_d))  # the "stream" reads them later
    ex._impl.device_submit(layer, hidden, ids, w, 4242)
    ready_ns, done_ns, experts, routes = ex._impl.device_sync(out_d.data_ptr(), 4242)
    lib.fake_sync()
    G = lambda k: banks.layers[layer].tensors[k]
    want = moe_reference(hidden, ids, w, G("gate_up"), G("down"))
    torch.testing.assert_close(out_d[:T], want, atol=1e-4, rtol=1e-4)
    assert out_d[T:].isnan().all() and routes == int((ids >= 0).sum()) and done_ns >= ready_ns
assert lib.fake_calls() == 12 * 5 and lib.fake_last_stream() == 4242
try:
    ex._impl.device_submit(0, torch.zeros(CAP + 1, D), torch.zeros(CAP + 1, A, dtype=torch.int64),
                           torch.zeros(CAP + 1, A), 4242)
    raise SystemExit("an oversized job was accepted")
except RuntimeError as exc:
    assert "exceed the handoff" in str(exc), exc
ex.close()
print("FAKE-DRIVER-OK")
"""


@CPU_PLAYS_THE_DEVICE
def test_eager_device_handoff_through_a_stand_in_driver(tmp_path):
    """The driver-API eager handoff (link_device / device_submit / device_sync), end to end on the CPU:
    a stand-in libcuda.so.1 runs every async copy late on a FIFO "stream" thread, so a job that did not
    wait for its ring flag value, a wrong copy size or an upload of the wrong rows fails the comparison.
    In a subprocess: the stand-in must not be seen by anything else in the test session."""
    import subprocess
    import sys

    lib = tmp_path / "libcuda.so.1"
    src = os.path.join(os.path.dirname(__file__), "fake_cuda_driver.c")
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), src, "-lpthread"],
                   check=True)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    run = subprocess.run([sys.executable, "-c", _FAKE_DRIVER_SCRIPT, str(lib)], capture_output=True, text=True,
                         cwd=root, timeout=300)
    assert run.returncode == 0 and "FAKE-DRIVER-OK" in run.stdout, run.stdout + run.stderr


def test_host_page_report_finds_the_banks_mappings():
    """The report covers the mappings that hold the banks (not the whole process), never counts more huge
    pages than bytes, and names the system's THP mode."""
    from services.engine.moe.banks import host_page_report

    big = torch.empty(64 << 20, dtype=torch.uint8)  # 64 MiB (the kernel may merge neighbouring mappings)
    report = host_page_report([big])
    mapped = 0  # every mapping of the process, for the upper bound
    for line in open("/proc/self/maps"):
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        mapped += hi - lo
    assert report["regions"] >= 1 and big.numel() <= report["bytes"] < mapped
    assert 0 <= report["huge_page_bytes"] <= report["bytes"] and report["thp"] in ("always", "madvise", "never")
    assert host_page_report([]) == {"bytes": 0, "huge_page_bytes": 0, "regions": 0, "thp": report["thp"]}
    more = torch.empty(80 << 20, dtype=torch.uint8)
    assert host_page_report([big, more])["bytes"] >= big.numel() + more.numel()


@pytest.mark.parametrize("setting", ["0", "2048:l1", "4096:l2", "8192:nta"])
def test_stream_prefetch_changes_no_result(executors, setting):
    """The stream prefetch only hints the caches: every setting gives the reference's output."""
    from services.engine.moe.cpu_executor import STREAM_PREFETCH, stream_prefetch

    banks, hidden, ids, weights = make_case(3, 4, 9, 2048, 96, torch.bfloat16, seed=5)  # rows of one 4 KB page
    ext = build_extension()
    try:
        ext.set_stream_prefetch(*stream_prefetch(setting))
        out = executors(banks).forward(0, hidden, ids, weights)
    finally:
        ext.set_stream_prefetch(*stream_prefetch(STREAM_PREFETCH))
    torch.testing.assert_close(out, reference(banks, hidden, ids, weights), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("bad", ["fast", "2048", "100:l1", "2048:l3", "-64:l1"])
def test_stream_prefetch_rejects_bad_settings(bad):
    from services.engine.moe.cpu_executor import stream_prefetch

    with pytest.raises(ValueError, match="stream prefetch"):
        stream_prefetch(bad)

"""No Triton compile on the request path: every kernel specialization that requests of random prompt lengths
and concurrency launch was already launched by the start-up work (``ModelRunner.warm_up`` and the decode
graph capture), so on a GPU its binary is in Triton's in-memory cache before the first request. Per expert
backend: ``resident``; ``offload`` (the cache kernels too: ensure, the fused copy); ``hybrid`` (its split
kernel at the sizes its eager CPU path splits here, decode steps: it backs off to offload where its fraction
is 1, so the split's old power-of-two block passed here; test_ensure_launch_fixed.py covers every size).

How (CPU, TRITON_INTERPRET): the model's fused ops and the expert kernels are forced onto Triton
(``models.fused.FORCE``), the expert cache's kernels too (``ExpertCache.use_triton``, CUDA-only by
default), and every launch records its specialization key as ``JITFunction.run`` builds it:
Triton's own binder (``create_function_from_signature`` over the kernel's ``KernelParam``s, each argument
through ``native_specialize_impl``) gives, per argument, the constexpr value, or the type and its
specialization: an int equal to 1 becomes a constexpr, an int or a pointer divisible by 16 gets 'D' (not
for ``do_not_specialize`` arguments), plus the launch options (num_warps, num_stages). Phase 1 records the
warm-up and the capture's forwards (the sizes ``DecodeGraphs`` captures, with the batches it builds; the
capture's eager check forwards too); phase 2 runs requests through a real Engine whose decode steps go
through a stand-in of the graphs that records nothing (a replay launches the captured kernels, it compiles
nothing). Phase 2's keys must be a subset of phase 1's.

Versions: this reads the binder of the installed Triton (3.8 on the dev box). Triton 3.6 (the GPU host) has
the same binder and ``native_specialize_impl`` (since 3.5); its cache key adds the target and the
compile options' string, which are the same for every launch of a process. What this does not see: the
CUDA backend's option defaults per device, and anything outside Triton (cuBLAS heuristics, SDPA, lazy
CUDA module loads) — the start-up prefill warms those, and ``test_no_compile_after_start_on_cuda`` below
counts real compiles on a GPU."""

from __future__ import annotations

import asyncio
import inspect
import random

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models import fused
from services.engine.runtime.kv_cache import ForwardBatch
from services.engine.runtime.runner import DecodeGraphs
from services.engine.runtime.sampler import SamplingParams

SLOTS, MAX_LEN = 4, 64


class LaunchKeys:
    """Records the specialization key of every Triton launch under the interpreter while ``on``."""

    def __init__(self) -> None:
        self.keys: set[tuple] = set()
        self.on = True
        self._binders: dict[object, object] = {}

    def key(self, fn, kwargs: dict, args: tuple, options: dict) -> tuple:
        from triton.backends.compiler import BaseBackend
        from triton.runtime.jit import KernelParam, create_function_from_signature

        binder = self._binders.get(fn.fn)
        if binder is None:
            sig = inspect.signature(fn.fn)
            dns = set(kwargs.get("do_not_specialize") or ())
            dns_oa = set(kwargs.get("do_not_specialize_on_alignment") or ())
            params = [KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
                      for i, p in enumerate(sig.parameters.values())]
            binder = self._binders[fn.fn] = create_function_from_signature(sig, params, BaseBackend)
        _, specialization, opts = binder(*args, **options)
        return (fn.fn.__qualname__, tuple(map(tuple, specialization)), tuple(sorted(opts.items())))

    def install(self, monkeypatch) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        run = InterpretedFunction.run
        recorder = self

        def recording_run(fn, *args, grid, warmup, **kw):
            if recorder.on:
                recorder.keys.add(recorder.key(fn, fn.kwargs, args, kw))
            return run(fn, *args, grid=grid, warmup=warmup, **kw)

        monkeypatch.setattr(InterpretedFunction, "run", recording_run)


class SilentReplay:
    """Stands in for the captured DecodeGraphs: ``run`` computes the decode rows as the captured forward
    does (``DecodeGraphs._batch``'s window and slot tensor) with recording off, as a replay compiles nothing."""

    def __init__(self, graphs: DecodeGraphs, recorder: LaunchKeys) -> None:
        self.real, self.recorder = graphs, recorder
        self.graphs = dict.fromkeys(graphs.sizes)
        self.replays = 0

    def run(self, input_ids, positions, slots, device_ids=None):
        n = len(positions)
        if n > self.real.max_batch:
            return None
        ids = device_ids if device_ids is not None else torch.tensor(input_ids)
        batch = ForwardBatch(slots=list(slots), start_pos=list(positions), query_lens=[1] * n,
                             kv_len=self.real.kv.max_seq_len, slot_ids=torch.tensor(slots))
        self.recorder.on = False
        try:
            self.replays += 1
            return self.real.model(ids, torch.tensor(positions), batch, self.real.kv)
        finally:
            self.recorder.on = True


def start_up(engine: Engine, recorder: LaunchKeys) -> DecodeGraphs:
    """What ModelRunner does at start on CUDA: warm_up, then per captured size the capture's forwards
    (two warm-up passes and the captured one share DecodeGraphs._batch; then the eager check's forward)."""
    runner = engine.runner
    runner.warm_up()
    graphs = DecodeGraphs(runner.model, runner.kv, max_batch=SLOTS, pad_slot=SLOTS - 1)
    for B in sorted(graphs.sizes, reverse=True):
        graphs._reset_inputs()
        runner.model(graphs.static[0, :B], graphs.static[1, :B], graphs._batch(B), graphs.kv)
        runner.model(torch.arange(3, 3 + B), torch.zeros(B, dtype=torch.long),
                     ForwardBatch(slots=list(range(B)), start_pos=[0] * B, query_lens=[1] * B), graphs.kv)
    return graphs


async def traffic(engine: Engine, seed: int, count: int, max_prompt: int) -> None:
    """``count`` requests per level of 1, 2 and SLOTS + 1 in flight: random prompt lengths up to
    ``max_prompt`` (half of them behind a shared prefix: prefix-cache hits, prefills that start past 0),
    random output lengths, greedy or sampled, some with logprobs."""
    rng = random.Random(seed)
    vocab = engine.loaded.spec.vocab_size
    shared = [rng.randrange(3, vocab) for _ in range(12)]
    # first the lengths at Triton's edges (1, multiples of 8 and 16 and their neighbours: routes R = T x A
    # divisible by 16 or not, each GEMM launch config), then random ones
    edges = iter(n for n in (16, 1, 2, 8, 9, 15, 17, 32, 33, max_prompt // 2, max_prompt) if n <= max_prompt)

    async def one(i: int, gate: asyncio.Semaphore) -> None:
        async with gate:
            prompt = [rng.randrange(3, vocab) for _ in range(next(edges, None) or rng.randint(1, max_prompt))]
            if i % 3 == 2:  # behind the shared prefix: a prefill that starts past position 0
                prompt = shared + prompt[:max_prompt - len(shared)]
            params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 0.8]),
                                    seed=i, ignore_eos=True, logprobs=rng.choice([None, 2]))
            async for _ in engine.submit(f"r{seed}-{i}", prompt, params):
                pass

    for concurrency in (1, 2, SLOTS + 1):
        gate = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(one(i, gate) for i in range(count)))
    # a prompt sent again once its slot is free: the prefix cache holds all but its last token, so the step
    # is one 1-token chunk at position 19, an eager forward whose rows are all query_len 1 (ForwardBatch.
    # is_decode): decode attention outside the graphs, at a window (20) no start-up forward had
    repeat = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = [rng.randrange(3, vocab) for _ in range(20)]
    for n in range(2):
        async for _ in engine.submit(f"r{seed}-repeat{n}", prompt, repeat):
            pass


# kernels the requests must have launched (a path fallen back to torch would make the check vacuous): the
# model's and the expert GEMM's, plus per backend its cache kernels (ensure or hybrid's split, the fused copy)
MODEL_KERNELS = {"_rms_norm_kernel", "_route_topk_kernel", "_gate_up_kernel"}
CACHE_KERNELS = {"resident": set(), "offload": {"_ensure_experts_kernel", "_copy_jobs_kernel"},
                 "hybrid": {"_split_misses_kernel", "_copy_jobs_kernel"}}
# offload and hybrid: 6 of tiny's 16 experts (2 layers x 8) in slots, so prefills miss, fetch and chunk
CACHE = dict(moe_cache_rate=0.375)


def cache_on_triton(monkeypatch) -> None:
    """The expert cache's kernels (ensure, hybrid's split, the fused copy) run on the device's tensors only on
    CUDA by default (ExpertCache.use_triton); here on the CPU's too, under the interpreter."""
    from services.engine.moe.cache import ExpertCache

    init = ExpertCache.__init__

    def init_on_triton(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.use_triton = True

    monkeypatch.setattr(ExpertCache, "__init__", init_on_triton)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches; on a GPU the test below")
@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid"])
def test_requests_launch_no_kernel_specialization_that_start_up_did_not(monkeypatch, backend):
    monkeypatch.setattr(fused, "FORCE", True)
    cfg = dict(model="synthetic:tiny", device="cpu", moe_backend=backend, max_running_requests=SLOTS,
               max_waiting_requests=64, max_seq_len=MAX_LEN)
    if backend != "resident":
        cache_on_triton(monkeypatch)
        cfg.update(CACHE, moe_cpu_threads=1)
    engine = Engine(EngineConfig(**cfg))
    engine.start()
    try:
        engine.wait_ready(120)
        recorder = LaunchKeys()
        recorder.install(monkeypatch)
        graphs = start_up(engine, recorder)
        if backend == "resident":
            assert engine.loaded.model.backend.decode.kind == "triton"
        warmed = set(recorder.keys)
        recorder.keys.clear()
        replay = SilentReplay(graphs, recorder)
        engine.runner.graphs = replay
        asyncio.run(traffic(engine, seed=0, count=6, max_prompt=40))
        assert replay.replays > 0
        launched = {k[0].rsplit(".", 1)[-1] for k in recorder.keys}  # kernel names (hybrid's split is nested)
        assert MODEL_KERNELS | CACHE_KERNELS[backend] <= launched, launched
        missed = sorted(recorder.keys - warmed, key=str)
        assert not missed, "compiled on the request path:\n" + "\n".join(map(str, missed))
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload", "hybrid"])
def test_no_compile_after_start_on_cuda(backend):
    """The real thing: after an engine reports ready (warm-up and capture done), random traffic makes Triton
    compile nothing (the runner's CompileWatch counts Triton's own compile hooks). Qwen3-30B-A3B's routing
    (E=128, top-8) at an eighth of the width, bf16; prompts up to 300 tokens cross the GEMM's launch
    configs and hybrid's split sizes up to its 256-token cap."""
    cfg = dict(model="synthetic:qwen3-moe-mini", device="cuda", dtype="bfloat16", moe_backend=backend,
               max_running_requests=SLOTS, max_waiting_requests=64, max_seq_len=512)
    if backend != "resident":
        cfg.update(moe_cache_rate=0.25, moe_cpu_threads=2)
    engine = Engine(EngineConfig(**cfg))
    engine.start()
    try:
        engine.wait_ready(600)
        watch = engine.runner.compile_watch
        assert watch.active
        asyncio.run(traffic(engine, seed=1, count=8, max_prompt=300))
        assert not watch.compiles, "compiled on the request path:\n" + "\n".join(
            f"{c['seconds']:.2f} s {c['kernel']}" for c in watch.compiles)
    finally:
        engine.shutdown()

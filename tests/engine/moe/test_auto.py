"""`--moe-backend auto`: offload without a profile (and the log says how to make one), hybrid when this
GPU's profile predicts it faster, a reload that switches backends while keeping the greedy tokens."""

import logging
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from services.common import profiles as P  # noqa: E402
from services.engine.config import EngineConfig  # noqa: E402
from services.engine.models.registry import build_backend, load_model  # noqa: E402
from services.engine.moe import auto, hybrid_split  # noqa: E402
from services.engine.moe.hybrid import HybridBackend  # noqa: E402
from services.engine.moe.offload import OffloadBackend  # noqa: E402
from services.engine.moe.split_buckets import TUNE_AFTER_STEPS  # noqa: E402
from tests.common.test_profiles import GPU, make_profile  # noqa: E402
from tests.helpers import greedy_generate  # noqa: E402

PROMPT = [(5 * i + 1) % 100 + 3 for i in range(12)]
NEW_TOKENS = 8


def fp32_profile(cpu_ov: float, pcie_ov: float) -> P.Profile:
    """A profile for the fp32 test models: the decision reads the format key of the engine's dtype."""
    p = make_profile(GPU, c_sync=0.0)
    k = P.KernelBandwidths(cpu_executor_bs1=cpu_ov, pcie_gather=pcie_ov)
    return p.model_copy(update={"kernels": {"float32": k},
                                "concurrent": {"float32": P.Concurrent(pcie_ov=pcie_ov, cpu_ov=cpu_ov)}})


@pytest.fixture(scope="module")
def qwen3(hf_checkpoints):
    ckpt = hf_checkpoints["qwen3_moe"]
    lm = load_model(EngineConfig(model=str(ckpt.dir)), attach_backend=False)
    lm.model.set_backend(build_backend(lm, EngineConfig(model=str(ckpt.dir))))
    return lm, ckpt.dir, greedy_generate(lm, PROMPT, NEW_TOKENS)


def auto_backend_for(lm, model_dir):
    cfg = EngineConfig(model=str(model_dir), moe_backend="auto", moe_cache_size=lm.spec.num_experts)
    backend = build_backend(lm, cfg)
    lm.model.set_backend(backend)
    return backend


def test_no_profile_means_offload_and_says_how(qwen3, tmp_path, monkeypatch, caplog):
    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO):
        backend = auto_backend_for(lm, model_dir)
    assert isinstance(backend.inner, OffloadBackend)
    assert "tandem bench bw" in caplog.text
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected
    assert backend.stats()["auto"]["chosen"] == "offload"


def test_profile_picks_hybrid_and_reload_switches(qwen3, tmp_path, monkeypatch):
    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    # the CPU test machine has no GPU uuid: stand in this GPU's identity, the profile itself is real
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)  # CPU adds 10x: hybrid
    backend = auto_backend_for(lm, model_dir)
    assert isinstance(backend.inner, HybridBackend)
    assert backend.stats()["auto"]["fetch_fraction"] == pytest.approx(20.0 / 220.0)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected
    assert backend.stats()["cache"]["cpu_computed"] > 0

    P.write_profile(fp32_profile(cpu_ov=2.0, pcie_ov=50.0), tmp_path)  # a slow CPU now: offload
    result = backend.reload_profile()
    assert result["rebuilt"] and result["auto"]["chosen"] == "offload"
    assert isinstance(backend.inner, OffloadBackend)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected


def test_fp8_experts_read_the_fp8_block_entry(hf_checkpoints, tmp_path, monkeypatch, caplog):
    """FP8 experts (--moe-expert-dtype fp8): auto decides from the profile's fp8_block entry, not the dtype's;
    without one it falls back to the dtype's entry and says so."""
    ckpt = hf_checkpoints["qwen3_moe"]
    cfg = EngineConfig(model=str(ckpt.dir), moe_expert_dtype="fp8", moe_backend="auto")
    lm = load_model(cfg, attach_backend=False)
    assert hybrid_split.profile_format(SimpleNamespace(dtype=lm.dtype, banks=lm.banks)) == ("fp8_block", "float32")
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    slow_cpu = fp32_profile(cpu_ov=2.0, pcie_ov=50.0)  # the float32 entry says offload ...
    fp8 = P.KernelBandwidths(cpu_executor_bs1=200.0, pcie_gather=20.0)  # ... the fp8_block entry hybrid
    P.write_profile(slow_cpu.model_copy(update={
        "kernels": {**slow_cpu.kernels, "fp8_block": fp8},
        "concurrent": {**slow_cpu.concurrent, "fp8_block": P.Concurrent(pcie_ov=20.0, cpu_ov=200.0)}}), tmp_path)
    backend = build_backend(lm, EngineConfig(model=str(ckpt.dir), moe_expert_dtype="fp8", moe_backend="auto",
                                             moe_cache_size=lm.spec.num_experts))
    assert isinstance(backend.inner, HybridBackend)
    assert backend.stats()["auto"]["fetch_fraction"] == pytest.approx(20.0 / 220.0)

    P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)  # no fp8_block entry
    with caplog.at_level(logging.WARNING):
        result = backend.reload_profile()
    assert result["auto"]["chosen"] == "hybrid"
    assert "no 'fp8_block' entry" in caplog.text and "'float32' rates instead" in caplog.text


def test_mxfp4_experts_read_the_mxfp4_entry(hf_checkpoints, tmp_path, monkeypatch, caplog):
    """gpt-oss's MXFP4 experts: auto decides from the profile's mxfp4 entry (`bench bw --dtype mxfp4`), not the
    dtype's, and warns of nothing; without one it falls back to the dtype's entry and says so."""
    ckpt = hf_checkpoints["gpt_oss"]
    lm = load_model(EngineConfig(model=str(ckpt.dir)), attach_backend=False)
    dtype = str(lm.dtype).removeprefix("torch.")
    assert hybrid_split.profile_format(SimpleNamespace(dtype=lm.dtype, banks=lm.banks)) == ("mxfp4", dtype)
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    slow_cpu = make_profile(GPU, c_sync=0.0)  # the dtype's entry says offload ...
    slow = P.KernelBandwidths(cpu_executor_bs1=2.0, pcie_gather=50.0)
    fast = P.KernelBandwidths(cpu_executor_bs1=200.0, pcie_gather=20.0)  # ... the mxfp4 entry hybrid
    P.write_profile(slow_cpu.model_copy(update={
        "kernels": {dtype: slow, "mxfp4": fast},
        "concurrent": {dtype: P.Concurrent(pcie_ov=50.0, cpu_ov=2.0),
                       "mxfp4": P.Concurrent(pcie_ov=20.0, cpu_ov=200.0)}}), tmp_path)
    with caplog.at_level(logging.WARNING):
        backend = build_backend(lm, EngineConfig(model=str(ckpt.dir), moe_backend="auto",
                                                 moe_cache_size=lm.spec.num_experts))
    assert isinstance(backend.inner, HybridBackend)
    assert backend.stats()["auto"]["fetch_fraction"] == pytest.approx(20.0 / 220.0)
    assert "entry" not in caplog.text  # the mxfp4 entry itself: no fallback warning

    P.write_profile(slow_cpu.model_copy(update={"kernels": {dtype: slow},
                                                "concurrent": {dtype: P.Concurrent(pcie_ov=50.0, cpu_ov=2.0)}}),
                    tmp_path)  # no mxfp4 entry
    with caplog.at_level(logging.WARNING):
        result = backend.reload_profile()
    assert result["auto"]["chosen"] == "offload"
    assert "no 'mxfp4' entry" in caplog.text and f"'{dtype}' rates instead" in caplog.text


@pytest.mark.parametrize("faster, rebuilds", [("offload", 1), ("hybrid", 2)])
def test_online_verdict_keeps_the_measured_faster(faster, rebuilds, qwen3, tmp_path, monkeypatch):
    """The profile says hybrid; step times then decide. Tokens stay right across the rebuilds."""
    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)
    backend = auto_backend_for(lm, model_dir)
    assert backend.current == "hybrid" and backend.may_rebuild  # the engine chains no steps yet
    seen_rebuilds, steps = 0, 0
    while not backend.settled and steps < 2000:  # hybrid first searches its split (~250 steps), then is timed
        seconds = 0.002 if backend.current == faster else 0.010  # per step of 2 tokens below
        seen_rebuilds += backend.observe_decode_step(seconds, tokens=2)
        steps += 1
    assert backend.settled and backend.current == faster and seen_rebuilds == rebuilds and not backend.may_rebuild
    assert steps > auto.WARMUP_STEPS + 2 * auto.TRIAL_STEPS + TUNE_AFTER_STEPS  # hybrid's search was waited for
    measured = backend.stats()["auto"]["measured_s_per_token"]  # backend -> bucket -> s/token
    assert measured[faster]["2"] == pytest.approx(0.001) and measured[auto.OTHER[faster]]["2"] == pytest.approx(0.005)
    assert backend.stats()["auto"]["bucket_verdict"] == {"2": faster}
    lm.model.set_backend(backend)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected
    assert backend.observe_decode_step(1.0, tokens=1) is False  # settled: no more switching


def test_verdict_per_bucket_keeps_hybrid_and_pins_offload_where_it_won(qwen3, tmp_path, monkeypatch):
    """Injected step times: hybrid faster at 1 sequence, offload faster at 4. Hybrid is kept, its bucket 4
    runs the offload path (f = 1, pinned) and bucket 1 keeps its tuned split; tokens stay right."""
    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)
    backend = auto_backend_for(lm, model_dir)
    per_token = {("hybrid", 1): 0.002, ("offload", 1): 0.010, ("hybrid", 4): 0.040, ("offload", 4): 0.008}
    steps = 0
    while not backend.settled and steps < 6000:
        tokens = 1 if steps % 2 else 4
        backend.observe_decode_step(per_token[(backend.current, tokens)] * tokens, tokens=tokens)
        steps += 1
    assert backend.settled and backend.current == "hybrid"
    described = backend.stats()["auto"]
    assert described["bucket_verdict"] == {"1": "hybrid", "4": "offload"}
    assert described["measured_s_per_token"]["offload"] == {"1": pytest.approx(0.010), "4": pytest.approx(0.008)}
    buckets = backend.inner.buckets
    assert buckets.states[buckets.by_name["4"]].pinned == 1.0 and buckets.states[buckets.by_name["1"]].pinned is None
    assert described["buckets"]["4"]["mode"] == "offload" and described["buckets"]["4"]["pinned"]
    assert backend.stats()["buckets"]["4"]["fetch_fraction"] == 1.0  # what the split kernel reads for 4 sequences
    assert int(buckets.f_view(buckets.by_name["4"])) == 1 << 16
    lm.model.set_backend(backend)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected


def test_engine_with_auto_serves_sixteen_and_shows_its_buckets(hf_checkpoints, tmp_path, monkeypatch):
    """A real engine under `auto` (profile: hybrid) at 16 concurrent greedy requests: each equals
    transformers alone, and /engine/v1/stats shows the per-bucket state."""
    import asyncio

    from services.engine.engine import Engine
    from services.engine.runtime.sampler import SamplingParams
    from tests.engine.runtime.test_batch_invariance import distinct_prompts
    from tests.helpers import hf_greedy, model_thread_held

    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
    P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)
    ckpt = hf_checkpoints["qwen3_moe"]
    engine = Engine(EngineConfig(model=str(ckpt.dir), device="cpu", moe_backend="auto", max_running_requests=16,
                                 max_waiting_requests=32, max_seq_len=64, moe_cache_rate=0.25))
    engine.start()
    try:
        engine.wait_ready(120)
        prompts = distinct_prompts(ckpt.hf.config.vocab_size, 16)

        async def run():
            async with model_thread_held(engine):
                streams = [engine.submit(f"r{i}", p, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
                           for i, p in enumerate(prompts)]
            outs = []
            for stream in streams:
                tokens = []
                async for out in stream:
                    tokens += out["token_ids"]
                outs.append(tokens)
            return outs, await engine.stats()

        outputs, stats = asyncio.run(run())
        for prompt, tokens in zip(prompts, outputs):
            assert tokens == hf_greedy(ckpt.hf, prompt, 4)
        experts = stats["experts"]
        assert experts["backend"] == "hybrid" and experts["auto"]["running"] == "hybrid"
        assert experts["buckets"]["16"]["steps"] >= 2 and "prefill" in experts["buckets"]
        assert experts["auto"]["buckets"]["16"]["mode"] in ("hybrid", "offload", "cpu")
    finally:
        engine.shutdown()


@pytest.mark.parametrize("first", ["offload", "hybrid"])
def test_switch_frees_the_old_backend_before_building_the_other(first, qwen3, tmp_path, monkeypatch):
    """A switch must free the running candidate's expert cache before the other one allocates its own: under
    --gpu-memory-limit one budget-sized cache fills most of the budget, and two at once ran out of memory
    (H200, qwen3-30b-a3b q4_K_M at 24 GiB: the engine failed at auto's first switch, 48 decode steps in).
    A reference to the old backend left in observe_decode_step's frame kept it alive through the build."""
    import gc
    import weakref

    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    if first == "hybrid":
        monkeypatch.setattr(auto, "gpu_uuid", lambda device: GPU)
        P.write_profile(fp32_profile(cpu_ov=200.0, pcie_ov=20.0), tmp_path)
    backend = auto_backend_for(lm, model_dir)
    assert backend.current == first
    old = weakref.ref(backend.inner)
    alive_at_build = []
    build = backend._build

    def build_after_checking(kind):
        gc.collect()
        alive_at_build.append(old() is not None)
        return build(kind)

    monkeypatch.setattr(backend, "_build", build_after_checking)
    steps = 0
    while not alive_at_build and steps < 2000:
        backend.observe_decode_step(0.002, tokens=1)
        steps += 1
    assert alive_at_build == [False] and backend.current == auto.OTHER[first]
    lm.model.set_backend(backend)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected


def test_a_candidate_that_does_not_fit_leaves_auto_on_the_one_that_ran(qwen3, tmp_path, monkeypatch, caplog):
    """Out of memory while building the other candidate (the device holds less than when the first was built):
    auto settles on the candidate that ran before and keeps serving, with a warning naming both."""
    lm, model_dir, expected = qwen3
    monkeypatch.setenv("TANDEM_PROFILES_DIR", str(tmp_path))
    backend = auto_backend_for(lm, model_dir)
    assert backend.current == "offload"
    build = backend._build

    def hybrid_does_not_fit(kind):
        if kind == "hybrid":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.40 GiB\nmore detail")
        return build(kind)

    monkeypatch.setattr(backend, "_build", hybrid_does_not_fit)
    rebuilt = False
    with caplog.at_level(logging.WARNING):
        for _ in range(2000):
            rebuilt = backend.observe_decode_step(0.002, tokens=1)
            if rebuilt:
                break
    assert rebuilt and backend.settled and backend.current == "offload"
    assert isinstance(backend.inner, OffloadBackend)
    assert "hybrid does not fit on the device (CUDA out of memory. Tried to allocate 9.40 GiB)" in caplog.text
    assert not any(backend.observe_decode_step(0.002, tokens=1) for _ in range(200))  # no further switch
    lm.model.set_backend(backend)
    assert greedy_generate(lm, PROMPT, NEW_TOKENS) == expected

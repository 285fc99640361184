"""A request's output does not depend on its neighbours: eight distinct greedy requests sent together
to one engine each get exactly the tokens transformers gives that prompt alone, on every expert backend
(fp32, CPU). With a small expert cache the eight route to different experts, so the batch's misses,
fetches and CPU shares differ from each request's own; none of that may change a token. With
--batch-invariant (resident, offload) the same holds through the mode's own paths: decode steps padded to
the largest batch, each prompt prefilled alone."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams
from tests.helpers import hf_greedy, model_thread_held

BACKENDS = ["resident", "offload", "cpu", "hybrid", "auto"]
NEW_TOKENS = 6


def distinct_prompts(vocab: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 11))] for _ in range(count)]


@pytest.mark.parametrize("backend, count, invariant", [(b, 8, False) for b in BACKENDS]
                         + [("hybrid", 16, False), ("cpu", 16, False), ("resident", 8, True), ("offload", 8, True)])
def test_concurrent_requests_each_equal_their_solo_output(hf_checkpoints, backend, count, invariant):
    """count = 16: decode steps of 16 tokens (128 routes, past the old 64-route limit of the split) take
    the split too, in their own bucket. invariant: --batch-invariant, whose offload cache must hold a decode
    step's experts in one pass (8 x top-2 routes over 8 experts: half of the 2 layers' 16)."""
    ckpt = hf_checkpoints["qwen3_moe"]
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.5 if invariant else 0.25}
    if invariant:
        extra["batch_invariant"] = True
    engine = Engine(EngineConfig(model=str(ckpt.dir), device="cpu", moe_backend=backend, max_running_requests=count,
                                 max_waiting_requests=2 * count, max_seq_len=64, **extra))
    engine.start()
    try:
        engine.wait_ready(120)
        prompts = distinct_prompts(ckpt.hf.config.vocab_size, count)

        async def run():
            # hold the model thread so all eight join one batch from its first step
            steps_before = (await engine.stats())["steps"]
            async with model_thread_held(engine):
                streams = [engine.submit(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, temperature=0,
                                                                     ignore_eos=True)) for i, p in enumerate(prompts)]
            outs = []
            for stream in streams:
                tokens = []
                async for out in stream:
                    tokens += out["token_ids"]
                outs.append(tokens)
            return outs, (await engine.stats())["steps"] - steps_before

        outputs, steps = asyncio.run(run())
        assert steps < NEW_TOKENS * len(prompts) // 2  # they really shared steps
        for prompt, tokens in zip(prompts, outputs):
            assert tokens == hf_greedy(ckpt.hf, prompt, NEW_TOKENS)
        if count == 16:  # the 16-token decode steps split in their own bucket, shown in the stats
            bucket = asyncio.run(engine.stats())["experts"]["buckets"]["16"]
            assert bucket["steps"] >= 2 and bucket["controller"]["cpu_bytes_per_second"] > 0  # the CPU took a share
    finally:
        engine.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload"])
def test_batch_invariant_bf16_on_cuda_each_equals_its_solo_output(backend):
    """--batch-invariant's promise where rounding really differs with the batch (bf16 on a GPU, Qwen3-30B-A3B's
    full width over 2 layers): eight distinct greedy requests decoded together give, token for token, what
    each gave alone on the same engine."""
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.5}  # >= 64 slots: a decode step in one pass
    engine = Engine(EngineConfig(model="synthetic:qwen3-30b-a3b?layers=2", device="cuda", dtype="bfloat16",
                                 moe_backend=backend, batch_invariant=True, max_running_requests=8,
                                 max_waiting_requests=16, max_seq_len=128, **extra))
    engine.start()
    try:
        engine.wait_ready(600)
        prompts = distinct_prompts(32000, 8)
        params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)

        async def collect(stream):
            return [t async for out in stream for t in out["token_ids"]]

        async def run():
            solo = [await collect(engine.submit(f"solo{i}", p, params)) for i, p in enumerate(prompts)]
            async with model_thread_held(engine):
                streams = [engine.submit(f"r{i}", p, params) for i, p in enumerate(prompts)]
            return solo, [await collect(s) for s in streams]

        solo, together = asyncio.run(run())
        differ = [i for i in range(len(prompts)) if solo[i] != together[i]]
        assert not differ, f"requests {differ} of 8 differ from their solo output"
    finally:
        engine.shutdown()

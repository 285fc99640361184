"""A request's output does not depend on its neighbours: eight distinct greedy requests sent together
to one engine each get exactly the tokens transformers gives that prompt alone, on every expert backend
(fp32, CPU). With a small expert cache the eight route to different experts, so the batch's misses,
fetches and CPU shares differ from each request's own; none of that may change a token."""

from __future__ import annotations

import asyncio
import random

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams
from tests.helpers import hf_greedy, model_thread_held

BACKENDS = ["resident", "offload", "cpu", "hybrid", "auto"]
NEW_TOKENS = 6


def distinct_prompts(vocab: int, count: int = 8) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 11))] for _ in range(count)]


@pytest.mark.parametrize("backend, count", [(b, 8) for b in BACKENDS] + [("hybrid", 16), ("cpu", 16)])
def test_concurrent_requests_each_equal_their_solo_output(hf_checkpoints, backend, count):
    """count = 16: decode steps of 16 tokens (128 routes, past the old 64-route limit of the split) take
    the split too, in their own bucket."""
    ckpt = hf_checkpoints["qwen3_moe"]
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.25}
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

"""decode_step_seconds counts the whole step, the forward included (issue 20 item 9): on the CPU the
forward runs inside ModelRunner.launch, so a step timed from the end of launch left it out."""

from __future__ import annotations

import asyncio
import time

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams

FORWARD_FLOOR_S = 0.05  # each forward is made to last at least this long


def test_decode_step_seconds_includes_the_forward_on_the_cpu(hf_checkpoints):
    engine = Engine(EngineConfig(model=str(hf_checkpoints["mixtral"].dir), max_seq_len=32))
    engine.start()
    try:
        engine.wait_ready(120)
        forward = engine.runner.forward_eager

        def slow_forward(*args, **kwargs):  # the real forward, then a known floor on its duration
            out = forward(*args, **kwargs)
            time.sleep(FORWARD_FLOOR_S)
            return out

        engine.runner.forward_eager = slow_forward

        async def run():
            stream = engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
            return [out async for out in stream]

        outs = asyncio.run(run())
        assert outs[-1]["finish_reason"] == "length"
        stats = asyncio.run(engine.stats())
        assert stats["decode_steps"] >= 4
        assert stats["decode_step_seconds"] / stats["decode_steps"] >= FORWARD_FLOOR_S
    finally:
        engine.shutdown()

"""The prefix cache: a prompt's longest prefix already in a KV slot is not prefilled again, and the
tokens are still exactly transformers'. A multi-turn chat reuses its own finished slot; users sharing a
system prompt get a copy of it from a running request's slot; a miss takes the least recently freed slot;
--no-prefix-cache turns all of it off."""

from __future__ import annotations

import asyncio

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import Request, Scheduler
from tests.helpers import hf_greedy


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def request(rid: str, prompt: list[int], n: int = 2) -> Request:
    return Request(rid, prompt, greedy(n), emit=lambda out: None)


def finish(sched: Scheduler, batch, token: int = 7) -> None:
    """Postprocess ``batch`` with ``token`` sampled by every row that samples."""
    sched.postprocess(batch, [token if s else None for s in batch.samples])


def test_a_finished_slot_serves_the_next_turn_and_misses_take_the_oldest_slot():
    sched = Scheduler(max_running=2, max_waiting=8, max_seq_len=64, eos_token_ids=[])
    sched.add(request("a", [1, 2, 3, 4], n=2))
    finish(sched, sched.schedule())  # prefill a, first token 7
    finish(sched, sched.schedule(), token=8)  # a decodes 7 -> 8 and finishes (max_tokens 2)
    assert not sched.running and sched.slot_tokens[0] == [1, 2, 3, 4, 7]  # 8 was never fed
    # the next turn: a's whole conversation plus the new user message
    sched.add(request("b", [1, 2, 3, 4, 7, 8, 9, 10]))
    batch = sched.schedule()
    assert batch.slots == [0] and batch.start_pos == [5] and batch.query_lens == [3] and not batch.kv_copies
    assert batch.requests[0].num_cached == 5
    finish(sched, batch)
    # an unrelated prompt takes the other (least recently freed, never used) slot, keeping slot 0's prefix
    sched.add(request("c", [50, 51, 52]))
    batch = sched.schedule()
    assert batch.slots == [1, 0] and batch.start_pos[0] == 0 and batch.query_lens[0] == 3
    assert sched.stats()["prefix_cache"] == {"enabled": True, "prompt_tokens": 15, "cached_tokens": 5}


def test_a_running_requests_prefix_is_copied_and_the_last_prompt_token_always_computed():
    sched = Scheduler(max_running=3, max_waiting=8, max_seq_len=64, eos_token_ids=[])
    system = [9, 8, 7, 6, 5]
    sched.add(request("a", system + [1, 1], n=10))
    finish(sched, sched.schedule())  # a is running, its prompt in slot 0
    sched.add(request("b", system + [2, 2, 2]))
    sched.add(request("c", system))  # the whole prompt cached: its last token is still computed
    batch = sched.schedule()
    assert batch.kv_copies == [(0, 1, 5), (0, 2, 4)]
    assert batch.start_pos[:2] == [5, 4] and batch.query_lens[:2] == [3, 1]


def test_off_means_every_prompt_is_prefilled_whole():
    sched = Scheduler(max_running=1, max_waiting=8, max_seq_len=64, eos_token_ids=[], prefix_cache=False)
    sched.add(request("a", [1, 2, 3], n=1))
    finish(sched, sched.schedule())
    sched.add(request("b", [1, 2, 3, 4]))
    batch = sched.schedule()
    assert batch.start_pos == [0] and batch.query_lens == [4] and not batch.kv_copies


@pytest.mark.parametrize("backend", ["resident", "hybrid"])
def test_cached_prefixes_give_transformers_tokens(hf_checkpoints, backend):
    ckpt = hf_checkpoints["qwen3_moe"]
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.25}
    engine = Engine(EngineConfig(model=str(ckpt.dir), device="cpu", moe_backend=backend, max_running_requests=3,
                                 max_seq_len=64, **extra))
    engine.start()
    try:
        engine.wait_ready(120)

        async def run(rid: str, prompt: list[int], n: int) -> tuple[list[int], dict]:
            tokens, last = [], None
            async for out in engine.submit(rid, prompt, greedy(n)):
                tokens += out["token_ids"]
                last = out
            return tokens, last

        turn1 = [3, 17, 42, 5, 9, 11]
        out1, last1 = asyncio.run(run("t1", turn1, 5))
        assert out1 == hf_greedy(ckpt.hf, turn1, 5) and last1["cached_tokens"] == 0
        turn2 = turn1 + out1 + [21, 22]  # the chat so far plus the next user message
        out2, last2 = asyncio.run(run("t2", turn2, 5))
        assert last2["cached_tokens"] == len(turn1) + 4  # the last output token was never fed
        assert out2 == hf_greedy(ckpt.hf, turn2, 5)

        async def shared_system_prompt():
            system = [60, 61, 62, 63, 64, 65, 66]
            first = asyncio.ensure_future(run("s1", system + [1], 12))
            while (await engine.stats())["running"] == 0:  # s1 prefilled and decoding
                await asyncio.sleep(0.01)
            return await asyncio.gather(first, run("s2", system + [2, 3], 4)), system

        ((s1, _), (s2, last_s2)), system = asyncio.run(shared_system_prompt())
        assert last_s2["cached_tokens"] == len(system)  # copied from s1's running slot
        assert s1 == hf_greedy(ckpt.hf, system + [1], 12) and s2 == hf_greedy(ckpt.hf, system + [2, 3], 4)
        assert asyncio.run(engine.stats())["prefix_cache"]["cached_tokens"] == len(turn1) + 4 + len(system)
    finally:
        engine.shutdown()

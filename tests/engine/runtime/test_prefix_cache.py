"""The prefix cache over KV blocks: a prompt's longest prefix already computed, in whole blocks of 16
tokens, is not prefilled again, and the tokens are still exactly transformers'. A multi-turn chat reuses its
own finished request's blocks; users sharing a system prompt share a running request's blocks;
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


def test_a_finished_requests_blocks_serve_the_next_turn():
    sched = Scheduler(max_running=2, max_waiting=8, max_seq_len=128, eos_token_ids=[])
    turn1 = list(range(100, 120))  # 20 tokens: one full block + 4
    sched.add(request("a", turn1, n=2))
    finish(sched, sched.schedule())  # prefill a, first token 7
    finish(sched, sched.schedule(), token=8)  # a decodes 7 -> 8 and finishes (max_tokens 2)
    assert not sched.running and sched.stats()["kv_blocks_cached"] == 1  # its one full block stays
    sched.add(request("b", turn1 + [7, 8] + list(range(30, 40))))  # the chat so far plus the next message
    batch = sched.schedule()
    assert batch.start_pos == [16] and batch.query_lens == [16] and batch.requests[0].num_cached == 16
    finish(sched, batch)
    sched.add(request("c", [50, 51, 52]))  # unrelated: no hit
    batch = sched.schedule()
    assert batch.start_pos[0] == 0 and batch.query_lens[0] == 3
    assert sched.stats()["prefix_cache"] == {"enabled": True, "prompt_tokens": 55, "cached_tokens": 16}


def test_a_running_requests_blocks_are_shared_and_the_last_prompt_token_always_computed():
    sched = Scheduler(max_running=3, max_waiting=8, max_seq_len=128, eos_token_ids=[])
    system = list(range(200, 232))  # two full blocks
    sched.add(request("a", system + [1, 1], n=10))
    finish(sched, sched.schedule())  # a is running, its two system blocks keyed
    sched.add(request("b", system + [2, 2, 2]))
    sched.add(request("c", system))  # the whole prompt cached: its last block is computed again
    batch = sched.schedule()
    assert batch.start_pos[:2] == [32, 16] and batch.query_lens[:2] == [3, 16]
    tables = sched.blocks.tables
    a, b, c = (r.slot for r in batch.requests[2:] + batch.requests[:2])
    assert tables[b][:2] == tables[a][:2] and tables[c][0] == tables[a][0] and tables[c][1] != tables[a][1]


def test_off_means_every_prompt_is_prefilled_whole():
    sched = Scheduler(max_running=1, max_waiting=8, max_seq_len=64, eos_token_ids=[], prefix_cache=False)
    prompt = list(range(20))
    sched.add(request("a", prompt, n=1))
    finish(sched, sched.schedule())
    sched.add(request("b", prompt + [4]))
    batch = sched.schedule()
    assert batch.start_pos == [0] and batch.query_lens == [21]


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

        turn1 = [3, 17, 42, 5, 9, 11, 13, 2, 8, 30, 31, 32, 33, 34]
        out1, last1 = asyncio.run(run("t1", turn1, 5))
        assert out1 == hf_greedy(ckpt.hf, turn1, 5) and last1["cached_tokens"] == 0
        turn2 = turn1 + out1 + [21, 22]  # the chat so far plus the next user message
        out2, last2 = asyncio.run(run("t2", turn2, 5))
        assert last2["cached_tokens"] == 16  # the first block: turn 1's 14 tokens + 2 of its 4 fed outputs
        assert out2 == hf_greedy(ckpt.hf, turn2, 5)

        async def shared_system_prompt():
            system = list(range(60, 76))  # one block
            first = asyncio.ensure_future(run("s1", system + [1], 12))
            while (await engine.stats())["running"] == 0:  # s1 prefilled and decoding
                await asyncio.sleep(0.01)
            return await asyncio.gather(first, run("s2", system + [2, 3], 4)), system

        ((s1, _), (s2, last_s2)), system = asyncio.run(shared_system_prompt())
        assert last_s2["cached_tokens"] == len(system)  # s1's block, shared while s1 runs
        assert s1 == hf_greedy(ckpt.hf, system + [1], 12) and s2 == hf_greedy(ckpt.hf, system + [2, 3], 4)
        assert asyncio.run(engine.stats())["prefix_cache"]["cached_tokens"] == 16 + len(system)
    finally:
        engine.shutdown()

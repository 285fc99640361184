"""Continuous batching on a real checkpoint: every request of a mixed, staggered batch gets exactly
the greedy tokens transformers gives it alone (prompts whole or prefilled in chunks); an abort frees
its KV slot."""

from __future__ import annotations

import asyncio

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import RequestTooLongError
from tests.helpers import hf_greedy, model_thread_held

PROMPTS = [[3, 17, 42, 5], [9, 9, 1], [100, 7, 64, 23, 11, 8, 90], [55], [12, 34, 56, 78, 90, 21]]


@pytest.fixture(scope="module")
def qwen3(hf_checkpoints):
    return hf_checkpoints["qwen3_moe"]


@pytest.fixture(scope="module", params=["cpu", "cpu-overlap", pytest.param("cuda", marks=pytest.mark.gpu)])
def engine(request, qwen3):
    """cpu-overlap: every decode step that can be is chained to the one before (decode overlap forced on;
    auto leaves it to CUDA graph replays, as the cuda engine here runs it)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    e = Engine(EngineConfig(model=str(qwen3.dir), device=request.param.split("-")[0], max_running_requests=3,
                            max_waiting_requests=16, max_seq_len=64,
                            decode_overlap="on" if request.param.endswith("overlap") else "auto"))
    e.start()
    e.wait_ready(120)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def chunked_engine(qwen3):
    """Prompts prefilled 3 tokens per step: every prompt of PROMPTS but two is chunked."""
    e = Engine(EngineConfig(model=str(qwen3.dir), device="cpu", max_running_requests=3, max_waiting_requests=16,
                            max_seq_len=64, max_prefill_tokens=3))
    e.start()
    e.wait_ready(120)
    yield e
    e.shutdown()


async def _collect(stream) -> tuple[list[int], dict]:
    tokens, last = [], None
    async for out in stream:
        tokens += out["token_ids"]
        last = out
    return tokens, last


def test_staggered_batch_matches_transformers_alone(engine, qwen3):
    lengths = [12, 5, 9, 14, 7]  # different lengths: requests join and leave the batch mid-way

    async def run():
        # Hold the model thread so all five arrive together: 3 start at once, 2 join mid-way as the
        # shorter ones finish (their prefill then shares a forward with the others' decode).
        steps_before = (await engine.stats())["steps"]
        async with model_thread_held(engine):
            streams = [engine.submit(f"req{i}", prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                       for i, (prompt, n) in enumerate(zip(PROMPTS, lengths))]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        return results, (await engine.stats())["steps"] - steps_before

    results, steps = asyncio.run(run())
    if engine.config.device.value == "cuda":  # decode steps replayed from graphs (3 slots: sizes 1, 2, 3)
        assert asyncio.run(engine.stats())["cuda_graph_sizes"] == [1, 2, 3]
    assert steps < sum(lengths) // 2  # really batched: alone they would take sum(lengths) steps
    for (tokens, last), prompt, n in zip(results, PROMPTS, lengths):
        assert tokens == hf_greedy(qwen3.hf, prompt, n)
        assert last["finish_reason"] == "length" and last["completion_tokens"] == n
        assert last["prompt_tokens"] == len(prompt)


def test_chunked_prefill_matches_transformers_alone(chunked_engine, qwen3):
    """Chunks of 3 prompt tokens share steps with the others' decode; tokens are transformers' alone."""
    lengths = [6, 4, 5, 3, 6]

    async def run():
        streams = [chunked_engine.submit(f"chunk{i}", prompt, SamplingParams(max_tokens=n, temperature=0,
                                                                             ignore_eos=True))
                   for i, (prompt, n) in enumerate(zip(PROMPTS, lengths))]
        return await asyncio.gather(*(_collect(s) for s in streams))

    steps_before = asyncio.run(chunked_engine.stats())["steps"]
    for (tokens, last), prompt, n in zip(asyncio.run(run()), PROMPTS, lengths):
        assert tokens == hf_greedy(qwen3.hf, prompt, n)
        assert last["prompt_tokens"] == len(prompt) and last["completion_tokens"] == n
    # 31 prompt tokens at 3 per step cannot take fewer than 11 steps: they really were chunked
    assert asyncio.run(chunked_engine.stats())["steps"] - steps_before >= 11


def test_chunked_prefill_keeps_seeded_sampling(chunked_engine, engine):
    """A seeded sampled request draws the same tokens whether its prompt was prefilled whole or in
    chunks: mid-prompt chunks never touch its generator."""
    if engine.config.device.value != "cpu":
        pytest.skip("compares with the CPU engine")

    async def run(e):
        stream = e.submit(f"seeded-{id(e)}", PROMPTS[2], SamplingParams(max_tokens=8, temperature=1.0, seed=5,
                                                                        ignore_eos=True))
        return (await _collect(stream))[0]

    assert asyncio.run(run(chunked_engine)) == asyncio.run(run(engine))


def test_seeded_sampling_reproducible_in_batches(engine):
    async def run(seeds):
        streams = [engine.submit(f"s{i}-{seed}", PROMPTS[0],
                                 SamplingParams(max_tokens=10, temperature=1.0, seed=seed, ignore_eos=True))
                   for i, seed in enumerate(seeds)]
        return [t for t, _ in await asyncio.gather(*(_collect(s) for s in streams))]

    alone = asyncio.run(run([7]))[0]
    batched = asyncio.run(run([1, 7, 2]))
    assert batched[1] == alone
    assert batched[0] != batched[2]


def test_abort_frees_the_slot(engine):
    async def run():
        stream = engine.submit("long", PROMPTS[0], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        first = await stream.__anext__()
        assert first["token_ids"]
        stream.abort()
        for _ in range(200):
            stats = await engine.stats()
            if stats["kv_slots_used"] == 0:
                return stats
            await asyncio.sleep(0.01)
        return await engine.stats()

    stats = asyncio.run(run())
    assert stats["kv_slots_used"] == 0 and stats["running"] == 0 and stats["requests_aborted"] >= 1


def test_too_long_names_the_limit(engine):
    async def run():
        engine.submit("x", [1] * 60, SamplingParams(max_tokens=10))

    with pytest.raises(RequestTooLongError, match="--max-seq-len 64"):
        asyncio.run(run())


def test_duplicate_request_id_refused_while_in_flight(engine):
    from services.engine.runtime.scheduler import InvalidRequestError

    async def run():
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        first = engine.submit("same-id", PROMPTS[0], params)
        with pytest.raises(InvalidRequestError, match="already in flight"):
            engine.submit("same-id", PROMPTS[1], params)
        await _collect(first)
        return await _collect(engine.submit("same-id", PROMPTS[1], params))  # reusable once finished

    tokens, last = asyncio.run(run())
    assert len(tokens) == 3 and last["finish_reason"] == "length"


def test_decode_overlap_chains_steps_only_when_asked(engine):
    """With overlap forced on, a lone request's decode steps are launched chained to the step before;
    auto on the CPU never chains (nothing runs ahead there). Either way the tokens are transformers' (above)."""
    async def run():
        before = (await engine.stats())["chained_steps"]
        await _collect(engine.submit("chain", PROMPTS[1], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
        return (await engine.stats())["chained_steps"] - before

    chained = asyncio.run(run())
    if engine.config.decode_overlap.value == "on":
        # 12 tokens: the prefill samples the first, then 11 decode steps, each launched with the step
        # before it still in flight; nothing is chained after the 12th, which ends the request
        assert chained == 11
    elif engine.config.device.value == "cpu":
        assert chained == 0
    else:  # CUDA graphs replay every decode step here
        assert chained == 11


def test_stop_token_mid_chain_ends_the_request_there(engine, qwen3):
    """A stop token sampled while the next step is already launched: the request ends on it, the chained
    step's token is dropped, the slot is free and the next request is still transformers' own."""
    expected = hf_greedy(qwen3.hf, PROMPTS[2], 9)
    stop = expected[5]
    cut = expected.index(stop) + 1  # the first time the stop id comes up

    async def run():
        tokens, last = await _collect(engine.submit("stop-mid", PROMPTS[2], SamplingParams(
            max_tokens=9, temperature=0, stop_token_ids=[stop])))
        after = await _collect(engine.submit("after-stop", PROMPTS[0], SamplingParams(
            max_tokens=6, temperature=0, ignore_eos=True)))
        return tokens, last, after, await engine.stats()

    tokens, last, (after, _), stats = asyncio.run(run())
    assert tokens == expected[:cut]
    assert last["finish_reason"] == "stop" and last["stop_token_id"] == stop and last["completion_tokens"] == cut
    assert after == hf_greedy(qwen3.hf, PROMPTS[0], 6)
    assert stats["kv_slots_used"] == 0 and stats["running"] == 0

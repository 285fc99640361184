"""The scheduler over a small paged KV pool (no model): requests are admitted by free blocks, a prompt
chunk shrinks to the blocks there are, a decode row that cannot grow preempts the newest request (which is
recomputed later, mostly from its own cached blocks), and a request that can never fit is refused up front."""

import pytest

from services.engine.runtime.block_manager import BlockManager
from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import Request, RequestTooLongError, Scheduler

BS = 4


def sched(num_blocks: int, running: int = 4, max_seq_len: int = 64, **kw) -> Scheduler:
    blocks = BlockManager(num_blocks, BS, running, max_seq_len)
    return Scheduler(running, 16, max_seq_len, eos_token_ids=[], blocks=blocks, **kw)


def req(rid: str, prompt: list[int], n: int, outs: dict) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                   outs.setdefault(rid, []).append)


def run_step(s: Scheduler, token: int = 5):
    b = s.schedule()
    s.postprocess(b, [token if x else None for x in b.samples])
    return b


def test_admission_waits_for_free_blocks_and_a_chunk_shrinks_to_them():
    s, outs = sched(num_blocks=1 + 5), {}  # 5 usable blocks = 20 tokens
    s.add(req("a", list(range(10, 22)), 4, outs))  # 12 tokens: 3 blocks
    s.add(req("b", list(range(30, 38)), 4, outs))  # 8 tokens: 2 blocks
    b = run_step(s)
    assert [r.request_id for r in b.requests] == ["a", "b"] and b.query_lens == [12, 8]
    assert s.blocks.num_free == 0
    b = s.schedule()  # a decodes (it needs a 4th block: b, the newest, is preempted for it)
    assert [r.request_id for r in b.requests] == ["a"] and s.stats()["preemptions"] == 1
    assert [r.request_id for r in s.waiting] == ["b"] and s.waiting[0].num_computed == 0


def test_a_preempted_request_is_recomputed_with_its_outputs_and_gives_the_same_stream():
    s, outs = sched(num_blocks=1 + 6, running=2), {}
    s.add(req("old", list(range(1, 9)), 12, outs))  # 8 prompt tokens
    s.add(req("new", list(range(40, 48)), 12, outs))
    run_step(s, 100)  # both prefilled: 2 + 2 blocks, both sampled 100
    t = 101
    while not s.stats()["preemptions"]:  # both decode; at 12 tokens each needs a 4th block: "new" is preempted
        run_step(s, t)
        t += 1
    new = s.waiting[0] if s.waiting else None
    assert new is not None and new.request_id == "new" and new.output_token_ids
    assert s.stats()["preemptions"] >= 1
    kept = list(new.output_token_ids)
    # "old" runs to its end; then "new" comes back: its prompt and all but its last token are prefilled again,
    # nothing is sampled by that prefill, and its stream goes on where it stopped
    while s.running and s.running[0].request_id == "old":
        run_step(s, 7)
    b = s.schedule()
    assert b.requests[0] is new and b.num_prefill == 1 and b.samples == [False]
    assert b.input_ids == (new.prompt_token_ids + kept)[b.start_pos[0]:new.num_tokens - 1]
    s.postprocess(b, [None])
    b = s.schedule()
    assert b.num_prefill == 0 and b.input_ids == [kept[-1]] and b.positions == [new.num_tokens - 1]
    assert new.output_token_ids == kept and [o["token_ids"] for o in outs["new"]].count([]) == 0


def test_the_recompute_takes_the_preempted_requests_own_blocks_from_the_prefix_cache():
    s, outs = sched(num_blocks=1 + 8, running=2), {}
    s.add(req("old", list(range(1, 13)), 20, outs))
    s.add(req("new", list(range(50, 62)), 20, outs))
    run_step(s)  # 3 + 3 blocks, 2 left
    while not s.stats()["preemptions"]:
        run_step(s)
    new = s.waiting[0]
    s.abort("old")  # room again
    b = s.schedule()
    assert b.requests[0] is new and b.start_pos[0] >= 12  # the prompt's three blocks were still cached


def test_a_request_larger_than_the_pool_is_refused_at_once():
    s = sched(num_blocks=1 + 5, max_seq_len=64)
    with pytest.raises(RequestTooLongError, match="exceeds the KV cache's 20 tokens"):
        s.add(req("big", list(range(18)), 4, {}))
    with pytest.raises(RequestTooLongError, match="--max-seq-len 64"):
        s.add(req("huge", list(range(60)), 10, {}))
    assert not s.has_work()


def test_stats_report_blocks_and_usage_as_held_by_running_requests():
    s, outs = sched(num_blocks=1 + 10), {}
    s.add(req("a", list(range(6)), 2, outs))
    run_step(s)
    st = s.stats()
    assert st["kv_blocks_total"] == 10 and st["kv_blocks_used"] == 2 and st["kv_usage"] == pytest.approx(0.2)
    run_step(s)  # a finishes: its blocks are free again (its full block kept as evictable prefix)
    st = s.stats()
    assert st["kv_blocks_used"] == 0 and st["kv_usage"] == 0 and st["kv_blocks_cached"] == 1

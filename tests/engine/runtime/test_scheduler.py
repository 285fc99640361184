"""Scheduler alone (no model): admission into slots, batch layout, stop rules, aborts, limits."""

import pytest

from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import (InvalidRequestError, QueueFullError, Request, RequestTooLongError,
                                               Scheduler)

EOS = 2


def _req(rid, prompt, outputs, **params):
    return Request(rid, list(prompt), SamplingParams(temperature=0, **params), outputs.setdefault(rid, []).append)


def test_batch_layout_prefill_then_decode_and_slot_reuse():
    s, outs = Scheduler(max_running=2, max_waiting=8, max_seq_len=64, eos_token_ids=[EOS]), {}
    for rid, prompt in (("a", [5, 6, 7]), ("b", [8, 9]), ("c", [10])):
        s.add(_req(rid, prompt, outs, max_tokens=2))
    b = s.schedule()  # a and b admitted (2 slots), c waits
    assert [r.request_id for r in b.requests] == ["a", "b"] and b.num_prefill == 2
    assert b.input_ids == [5, 6, 7, 8, 9] and b.positions == [0, 1, 2, 0, 1]
    assert b.slots == [0, 1] and b.start_pos == [0, 0] and b.query_lens == [3, 2]
    s.postprocess(b, [11, 12])
    b = s.schedule()  # decode only: the last sampled token at its position
    assert b.num_prefill == 0 and b.input_ids == [11, 12] and b.positions == [3, 2] and b.start_pos == [3, 2]
    s.postprocess(b, [13, 14])  # max_tokens=2 reached: both finish, slots free
    assert outs["a"][-1]["finish_reason"] == "length" and outs["a"][-1]["completion_tokens"] == 2
    b = s.schedule()
    assert [r.request_id for r in b.requests] == ["c"] and b.slots[0] in (0, 1)
    assert s.stats()["waiting"] == 0 and s.stats()["kv_slots_used"] == 1


def test_eos_stops_unless_ignored_and_stop_token_ids():
    s, outs = Scheduler(3, 8, 64, [EOS]), {}
    s.add(_req("eos", [5], outs, max_tokens=5))
    s.add(_req("ignore", [5], outs, max_tokens=5, ignore_eos=True))
    s.add(_req("custom", [5], outs, max_tokens=5, stop_token_ids=[9]))
    b = s.schedule()
    s.postprocess(b, [EOS, EOS, 9])
    assert outs["eos"][-1]["finish_reason"] == "stop" and outs["eos"][-1]["stop_token_id"] == EOS
    assert outs["ignore"][-1]["finish_reason"] is None
    assert outs["custom"][-1]["finish_reason"] == "stop" and outs["custom"][-1]["stop_token_id"] == 9
    assert [r.request_id for r in s.running] == ["ignore"]


def test_abort_frees_slot_from_running_and_waiting():
    s, outs = Scheduler(1, 8, 64, [EOS]), {}
    s.add(_req("run", [5, 6], outs, max_tokens=10))
    s.add(_req("wait", [7], outs, max_tokens=10))
    s.postprocess(s.schedule(), [3])
    assert s.abort("wait") is not None and outs["wait"][-1]["finish_reason"] == "abort"
    assert s.abort("run") is not None and outs["run"][-1] == {"token_ids": [], "finish_reason": "abort",
                                                              "prompt_tokens": 2, "completion_tokens": 1,
                                                              "cached_tokens": 0}
    assert s.abort("run") is None
    assert s.stats()["kv_slots_used"] == 0 and not s.has_work()


def test_limits():
    s, outs = Scheduler(1, 1, 16, [EOS]), {}
    with pytest.raises(RequestTooLongError, match="--max-seq-len 16"):
        s.add(_req("long", [1] * 10, outs, max_tokens=7))
    with pytest.raises(InvalidRequestError):
        s.add(_req("empty", [], outs, max_tokens=1))
    s.add(_req("one", [1], outs, max_tokens=1))
    with pytest.raises(QueueFullError):
        s.add(_req("two", [1], outs, max_tokens=1))


def test_sequence_ends_at_max_seq_len():
    s, outs = Scheduler(1, 1, 8, [EOS]), {}
    s.add(_req("a", [1] * 6, outs, max_tokens=2))
    s.postprocess(s.schedule(), [3])
    s.postprocess(s.schedule(), [4])
    assert outs["a"][-1]["finish_reason"] == "length" and not s.has_work()


def test_backend_stats_flattened_for_metrics():
    from services.engine.reports import flat_backend_stats

    raw = {"backend": "hybrid", "cache": {"hits": 3, "misses": 2, "fetched": 1, "cpu_computed": 1},
           "bandwidth_bytes_per_second": {"pcie": 5e10, "cpu": 7e10}, "fetch_fraction": 0.4}
    flat = flat_backend_stats(raw)
    assert (flat["hits"], flat["misses"], flat["fetched"], flat["cpu_computed"]) == (3, 2, 1, 1)
    assert flat["pcie_bytes_per_second"] == 5e10 and flat["cpu_bytes_per_second"] == 7e10
    assert flat["cache"] == raw["cache"] and flat["fetch_fraction"] == 0.4


def test_chunked_prefill_keeps_decode_going_and_samples_once():
    """A 10-token prompt under a 4-token budget is prefilled in 3 steps (4, 4, 2) while the request
    already running decodes one token in each; only the last chunk samples."""
    s, outs = Scheduler(2, 8, 64, [EOS], max_prefill_tokens=4), {}
    s.add(_req("run", [5, 6], outs, max_tokens=8))
    s.postprocess(s.schedule(), [20])  # "run" prefilled whole (2 <= 4) and sampled
    s.add(_req("long", list(range(30, 40)), outs, max_tokens=3))
    chunks = []
    for step in range(3):
        b = s.schedule()
        assert [r.request_id for r in b.requests] == ["long", "run"] and b.num_prefill == 1
        chunks.append((b.start_pos[0], b.query_lens[0], b.samples))
        assert b.input_ids[:-1] == list(range(30 + b.start_pos[0], 30 + b.start_pos[0] + b.query_lens[0]))
        assert b.input_ids[-1] == 20 + step and b.positions[-1] == 2 + step  # "run" decodes every step
        s.postprocess(b, [None if not b.samples[0] else 90, 21 + step])
    assert chunks == [(0, 4, [False, True]), (4, 4, [False, True]), (8, 2, [True, True])]
    assert [o["token_ids"] for o in outs["long"]] == [[90]]  # nothing emitted before the prompt ended
    b = s.schedule()  # both decode now
    assert b.num_prefill == 0 and b.input_ids == [23, 90] and b.positions == [5, 10]  # admission order


def test_a_new_prompt_takes_what_the_budget_leaves():
    s, outs = Scheduler(3, 8, 64, [EOS], max_prefill_tokens=6), {}
    for rid, n in (("a", 4), ("b", 5)):
        s.add(_req(rid, range(10, 10 + n), outs, max_tokens=2))
    b = s.schedule()
    assert b.query_lens == [4, 2] and b.samples == [True, False] and b.num_tokens == 6
    s.postprocess(b, [50, None])
    b = s.schedule()  # b's remaining 3 tokens, then a's decode
    assert [r.request_id for r in b.requests] == ["b", "a"] and b.start_pos == [2, 4] and b.query_lens == [3, 1]


def test_continue_batch_only_when_nothing_else_is_due():
    """A chained step: the same rows at the pending tokens' positions, ids PENDING; None when a prompt is
    mid-chunk, a row's pending token ends it, or a waiting request could take a free slot."""
    from services.engine.runtime.scheduler import PENDING

    s, outs = Scheduler(max_running=3, max_waiting=8, max_seq_len=64, eos_token_ids=[EOS], max_prefill_tokens=4), {}
    s.add(_req("a", [5, 6, 7], outs, max_tokens=3))
    s.add(_req("b", [8, 9], outs, max_tokens=5))
    b = s.schedule()  # a whole, b's first token of prompt only (budget 4): b did not sample
    assert b.query_lens == [3, 1] and s.continue_batch(b) is None
    s.postprocess(b, [11, None])
    b = s.schedule()  # b's last prompt token + a's decode: both sample
    chained = s.continue_batch(b)
    assert [r.request_id for r in chained.requests] == ["b", "a"] and chained.num_prefill == 0
    assert chained.input_ids == [PENDING, PENDING] and chained.positions == [2, 4] == chained.start_pos
    assert chained.slots == b.slots and chained.query_lens == [1, 1]
    s.postprocess(b, [12, 13])  # a has 2 of 3 tokens: its next ends it by max_tokens
    assert s.continue_batch(s.schedule()) is None
    s2, outs2 = Scheduler(max_running=2, max_waiting=8, max_seq_len=64, eos_token_ids=[EOS]), {}
    s2.add(_req("x", [5], outs2, max_tokens=9))
    first = s2.schedule()
    s2.add(_req("y", [6], outs2, max_tokens=9))  # arrived while x ran, and a slot is free: schedule it next
    assert s2.continue_batch(first) is None


def test_one_prompt_per_step_cuts_each_prompt_as_if_it_were_alone():
    """--batch-invariant (which turns the prefix cache off): a step holds one prompt chunk with the whole
    budget, so b waits while a prefills and is then prefilled whole, not cut [2, 3] as above (where a's chunk
    left it 2)."""
    s, outs = Scheduler(3, 8, 64, [EOS], max_prefill_tokens=6, prefix_cache=False, one_prompt_per_step=True), {}
    for rid, n in (("a", 4), ("b", 5)):
        s.add(_req(rid, range(10, 10 + n), outs, max_tokens=2))
    b = s.schedule()
    assert [r.request_id for r in b.requests] == ["a"] and b.query_lens == [4]
    s.postprocess(b, [50])
    b = s.schedule()  # b whole, then a's decode
    assert [r.request_id for r in b.requests] == ["b", "a"] and b.query_lens == [5, 1] and b.num_prefill == 1

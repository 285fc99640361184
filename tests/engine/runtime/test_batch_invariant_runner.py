"""--batch-invariant in the runner, driven on the CPU: every decode step runs at max_running_requests rows
(the one captured graph's size; eagerly at that size without graphs), the padding rows go to the spare KV
slot and write nothing a request owns, and each prompt chunk of a step is a forward of its own."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch
from services.engine.runtime.runner import DecodeGraphs, ModelRunner
from services.engine.runtime.scheduler import ScheduledBatch

SLOTS = 4


def _runner(**kw) -> ModelRunner:
    loaded = load_model(EngineConfig(model="synthetic:tiny", max_seq_len=64))
    return ModelRunner(loaded, SLOTS, 64, torch.device("cpu"), torch.float32, batch_invariant=True, **kw)


def _prefill(runner, slot, prompt):
    runner.model(torch.tensor(prompt), torch.arange(len(prompt)),
                 ForwardBatch(slots=[slot], start_pos=[0], query_lens=[len(prompt)]), runner.kv)


def _spy_forwards(runner) -> list[tuple[int, list[int]]]:
    """Record (rows, slots) of every model forward."""
    calls, real = [], runner.model

    def spy(ids, pos, batch, kv):
        calls.append((ids.shape[0], list(batch.slots)))
        return real(ids, pos, batch, kv)

    runner.model = spy
    return calls


def test_only_the_largest_graph_is_captured(monkeypatch):
    monkeypatch.setattr(DecodeGraphs, "capture", lambda self, report=None: None)
    runner = _runner()
    runner._capture()
    assert runner.graphs.sizes == [SLOTS] and runner.graphs.pad_slot == SLOTS == runner.kv.num_slots - 1


class FakeGraph:
    """Stands in for a captured graph: a replay records the static inputs it would read."""

    def __init__(self, static):
        self.static, self.seen = static, []

    def replay(self):
        self.seen.append(self.static.clone())


def test_every_decode_step_replays_the_max_size_graph_with_padding_rows():
    runner = _runner()
    graphs = DecodeGraphs(runner.model, runner.kv, SLOTS, runner.pad_slot, sizes=[SLOTS])
    graph, out = FakeGraph(graphs.static), torch.arange(SLOTS * 3.0).view(SLOTS, 3)
    graphs.graphs[SLOTS] = (graph, out)
    runner.graphs = graphs
    for n in range(1, SLOTS + 1):
        slots = list(range(n))[::-1]
        batch = ScheduledBatch([None] * n, 0, [7] * n, [5] * n, slots, [5] * n, [1] * n)
        logits = runner._forward_invariant(batch, None)
        torch.testing.assert_close(logits, out[:n])
        seen = graph.seen[-1]  # [3, SLOTS]: ids, positions, slots
        assert seen[:, :n].tolist() == [[7] * n, [5] * n, slots]
        assert seen[:, n:].tolist() == [[0] * (SLOTS - n), [0] * (SLOTS - n), [SLOTS] * (SLOTS - n)]
    assert len(graph.seen) == SLOTS


def test_without_graphs_decode_rows_run_eagerly_at_the_max_size_and_padding_touches_no_live_slot():
    runner = _runner()
    assert runner.graphs is None and runner.kv.num_slots == SLOTS + 1  # the spare slot of the padding rows
    for slot, prompt in ((1, [3, 4, 5, 6]), (2, [9, 8, 7])):
        _prefill(runner, slot, prompt)
    # a dense cache: slot s owns blocks 1 + s MB .. (s + 1) MB, so past the null block it reads [slots, positions, ...]
    caches = [t[1:].view(runner.kv.num_slots, -1, *t.shape[2:]) for layer in (runner.kv.k, runner.kv.v) for t in layer]
    before = [t.clone() for t in caches]
    calls = _spy_forwards(runner)
    batch = ScheduledBatch([None] * 2, 0, [40, 41], [4, 3], [1, 2], [4, 3], [1, 1])
    logits = runner._forward_invariant(batch, None)
    assert calls == [(SLOTS, [1, 2, SLOTS, SLOTS])] and logits.shape[0] == 2
    for old, new in zip(before, caches):
        written = torch.zeros(new.shape[:2], dtype=torch.bool)
        written[1, 4] = written[2, 3] = True  # the two rows' own tokens
        written[SLOTS] = True  # the spare slot: the padding rows'
        assert torch.equal(old[~written], new[~written])  # no other entry of any slot changed
        assert not torch.equal(old[1, 4], new[1, 4])
    # the same two rows in another batch (a third request decoding beside them) give the same logits
    _prefill(runner, 0, [1, 2])
    again = runner._forward_invariant(ScheduledBatch([None] * 3, 0, [40, 41, 50], [4, 3, 2], [1, 2, 0], [4, 3, 2],
                                                     [1, 1, 1]), None)
    assert torch.equal(again[:2], logits)


def test_a_mixed_step_runs_each_prompt_chunk_alone_and_the_decode_rows_padded():
    runner = _runner()
    _prefill(runner, 1, [3, 4, 5, 6])
    calls = _spy_forwards(runner)
    batch = ScheduledBatch([None] * 3, 2, [11, 12, 13, 21, 22, 40], [0, 1, 2, 0, 1, 4], [0, 3, 1], [0, 0, 4],
                           [3, 2, 1])
    logits = runner._forward_invariant(batch, None)
    assert calls == [(3, [0]), (2, [3]), (SLOTS, [1, SLOTS, SLOTS, SLOTS])] and logits.shape[0] == 3

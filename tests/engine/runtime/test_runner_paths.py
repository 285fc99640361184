"""The runner's CUDA-only paths, driven on the CPU: ``warm_up`` (run at start on CUDA; called by hand here) calls
the backend's kernel warm-up with a row of the model's width and dtype, runs one eager prefill, reports phase
"compiling" up to done == total and leaves no request state behind; a step with prompt chunks and decode rows
split into an eager prefill and a decode "replay" (a stand-in graph set running the decode rows eagerly)
gives the logits of the one-forward step, row for row."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch
from services.engine.runtime.runner import ModelRunner
from services.engine.runtime.scheduler import ScheduledBatch


def test_warm_up_compiles_through_the_backend_and_reports_progress(monkeypatch):
    from services.engine.models.attention import Attention

    prefills = []
    real = Attention._prefill
    monkeypatch.setattr(Attention, "_prefill", lambda self, q, k, v, batch, *a: prefills.append(batch.num_seqs)
                        or real(self, q, k, v, batch, *a))
    loaded = load_model(EngineConfig(model="synthetic:tiny", max_seq_len=128))
    events, warmed = [], []
    loaded.model.backend.warm = lambda hidden: warmed.append((tuple(hidden.shape), hidden.dtype)) or 3
    runner = ModelRunner(loaded, 2, 128, torch.device("cpu"), torch.float32, progress=events.append)
    assert not warmed and not events  # on the CPU nothing runs at start
    ids = torch.tensor([5, 6, 7])
    batch = ForwardBatch(slots=[0], start_pos=[0], query_lens=[3])
    before = runner.model(ids, torch.arange(3), batch, runner.kv).clone()
    prefills.clear()
    runner.warm_up()
    assert warmed == [((1, loaded.spec.hidden_size), torch.float32)]
    assert prefills == [1] * loaded.spec.num_layers + [2] * loaded.spec.num_layers  # one prompt, then two packed
    assert [e["phase"] for e in events] == ["compiling"] * 3 and events[-1]["done"] == events[-1]["total"]
    torch.testing.assert_close(runner.model(ids, torch.arange(3), batch, runner.kv), before, atol=0, rtol=0)


class EagerDecodeGraphs:
    """Stands in for DecodeGraphs: ``run`` computes the decode rows with an eager forward."""

    def __init__(self, runner: ModelRunner, sizes) -> None:
        self.runner, self.graphs, self.calls = runner, dict.fromkeys(sizes), []

    def run(self, input_ids, positions, slots, device_ids=None):
        if not any(b >= len(positions) for b in self.graphs):
            return None
        self.calls.append(len(positions))
        batch = ForwardBatch(slots=list(slots), start_pos=list(positions), query_lens=[1] * len(positions))
        return self.runner.model(torch.tensor(input_ids), torch.tensor(positions), batch, self.runner.kv)


def test_a_mixed_step_splits_into_prefill_and_replay_with_the_same_logits():
    loaded = load_model(EngineConfig(model="synthetic:tiny", max_seq_len=64))
    runner = ModelRunner(loaded, 4, 64, torch.device("cpu"), torch.float32)
    for slot, prompt in ((1, [3, 4, 5, 6]), (2, [9, 8, 7])):  # two requests past their prompts
        runner.model(torch.tensor(prompt), torch.arange(len(prompt)),
                     ForwardBatch(slots=[slot], start_pos=[0], query_lens=[len(prompt)]), runner.kv)
    # a new 5-token prompt in slot 0, a chunk of 2 of another in slot 3, then decode rows of slots 1 and 2
    batch = ScheduledBatch([None] * 4, 2, [11, 12, 13, 14, 15, 21, 22, 40, 41], [0, 1, 2, 3, 4, 0, 1, 4, 3],
                           [0, 3, 1, 2], [0, 0, 4, 3], [5, 2, 1, 1])
    whole = runner.forward_eager(batch).clone()  # [4, V]
    runner.graphs = EagerDecodeGraphs(runner, [2])
    split = runner._forward_mixed(batch)
    assert runner.graphs.calls == [2]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    runner.graphs = EagerDecodeGraphs(runner, [1])  # no graph fits the 2 decode rows: one eager forward
    assert runner._forward_mixed(batch) is None
    loaded.model.backend.observe_decode_step = lambda seconds, tokens: False  # a backend timing its steps
    runner.graphs = EagerDecodeGraphs(runner, [2])
    assert runner._forward_mixed(batch) is None and not runner.graphs.calls


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_start_warms_captures_every_size_and_splits_mixed_steps():
    """The real thing: Qwen3-30B-A3B's routing (E=128, top-8) at an eighth of the width, bf16, resident."""
    loaded = load_model(EngineConfig(model="synthetic:qwen3-moe-mini", device="cuda", dtype="bfloat16",
                                     max_seq_len=64))
    events = []
    runner = ModelRunner(loaded, 5, 64, torch.device("cuda"), torch.bfloat16, progress=events.append)
    assert sorted(runner.graphs.graphs) == [1, 2, 3, 4, 5]  # every size: no padding rows
    phases = [e["phase"] for e in events]
    assert phases[0] == "compiling" and phases[-1] == "capturing" and events[-1]["done"] == 5
    assert loaded.model.backend.decode.kind == "triton", "the expert kernels fell back to torch"
    for slot, prompt in ((1, [3, 4, 5, 6]), (2, [9, 8, 7]), (3, [1, 2])):
        runner.model(torch.tensor(prompt, device="cuda"), torch.arange(len(prompt), device="cuda"),
                     ForwardBatch(slots=[slot], start_pos=[0], query_lens=[len(prompt)]), runner.kv)
    # a 20-token prompt in slot 0 (160 routes: the grouped GEMM), decode rows of slots 1-3 (a replay)
    prompt = list(range(100, 120))
    batch = ScheduledBatch([None] * 4, 1, prompt + [40, 41, 42], list(range(20)) + [4, 3, 2], [0, 1, 2, 3],
                           [0, 4, 3, 2], [20, 1, 1, 1])
    split = runner._forward_mixed(batch).float()
    whole = runner.forward_eager(batch).float()
    scale = whole.abs().max().item()
    assert (split - whole).abs().max().item() <= 0.05 * scale  # the capture check's bound (bf16 kernels)

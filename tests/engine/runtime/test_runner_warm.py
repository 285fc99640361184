"""ModelRunner.warm_up (run at start on CUDA; here called by hand on the CPU): the backend's kernel warm-up is
called with a row of the model's width and dtype, one eager prefill runs, progress reports phase "compiling"
up to done == total, and the warm-up leaves no request state behind (a fresh slot 0 still decodes like a
runner that never warmed)."""

from __future__ import annotations

import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch
from services.engine.runtime.runner import ModelRunner


def test_warm_up_compiles_through_the_backend_and_reports_progress():
    loaded = load_model(EngineConfig(model="synthetic:tiny", max_seq_len=128))
    events, warmed = [], []
    loaded.model.backend.warm = lambda hidden: warmed.append((tuple(hidden.shape), hidden.dtype)) or 3
    runner = ModelRunner(loaded, 2, 128, torch.device("cpu"), torch.float32, progress=events.append)
    assert not warmed and not events  # on the CPU nothing runs at start
    ids = torch.tensor([5, 6, 7])
    batch = ForwardBatch(slots=[0], start_pos=[0], query_lens=[3])
    before = runner.model(ids, torch.arange(3), batch, runner.kv).clone()
    runner.warm_up()
    assert warmed == [((1, loaded.spec.hidden_size), torch.float32)]
    assert [e["phase"] for e in events] == ["compiling"] * 3 and events[-1]["done"] == events[-1]["total"]
    torch.testing.assert_close(runner.model(ids, torch.arange(3), batch, runner.kv), before, atol=0, rtol=0)

"""Engine lifecycle as /health reports it: loading (with the loader's progress) -> serving; a load
that fails -> maintenance "failed" with the reason, and requests refused (503) instead of hanging."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.engine_status import EngineNotReadyError
from services.engine.models.registry import load_model
from services.engine.runtime.sampler import SamplingParams


def test_health_reports_loading_progress_then_serving(hf_checkpoints):
    gate = threading.Event()

    def gated_load(config, progress=None):
        progress({"phase": "loading", "done": 1, "total": 4, "fraction": 0.25})
        gate.wait(30)  # hold the engine in the loading state while the test looks at /health
        return load_model(config, progress=progress)

    engine = Engine(EngineConfig(model=str(hf_checkpoints["mixtral"].dir), max_seq_len=32), load=gated_load)
    engine.start()
    try:
        deadline = time.monotonic() + 10
        while engine.health().get("progress", {}).get("done") != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        health = engine.health()
        assert health["status"] == "loading" and health["progress"]["fraction"] == 0.25

        async def early():
            engine.submit("early", [1, 2], SamplingParams(max_tokens=1))

        with pytest.raises(EngineNotReadyError):
            asyncio.run(early())
        gate.set()
        engine.wait_ready(60)
        health = engine.health()
        assert health["status"] == "ok" and health["maintenance"] == "serving"
        assert engine.info()["max_seq_len"] == 32
    finally:
        gate.set()
        engine.shutdown()


def test_failed_load_is_reported_and_refuses_requests(tmp_path):
    engine = Engine(EngineConfig(model=str(tmp_path / "missing-checkpoint")))
    engine.start()
    with pytest.raises(RuntimeError, match="missing-checkpoint"):
        engine.wait_ready(30)
    health = engine.health()
    assert health["status"] == "ok" and health["maintenance"] == "failed" and "missing-checkpoint" in health["error"]

    async def submit():
        engine.submit("x", [1], SamplingParams(max_tokens=1))

    with pytest.raises(EngineNotReadyError, match="failed"):
        asyncio.run(submit())
    engine.shutdown()


def test_a_failure_of_the_step_loop_names_itself_to_the_stream_and_the_log(hf_checkpoints, caplog):
    """An exception outside the per-step guards (here the backend observation after a decode step: `auto`
    rebuilding its backend ran out of memory there) stops the engine: the log has it at ERROR with its
    traceback, /health says failed, and every open stream ends with finish "abort" and an error naming it
    (the gateway's error event) instead of a bare abort."""
    import logging

    engine = Engine(EngineConfig(model=str(hf_checkpoints["mixtral"].dir), max_seq_len=32, device="cpu"))
    engine.start()
    try:
        engine.wait_ready(60)
        observe, calls = engine._observe_backend, []

        def failing_observe(batch, seconds):
            calls.append(batch.num_prefill)
            if len(calls) == 4:
                raise RuntimeError("CUDA out of memory (injected)")
            observe(batch, seconds)

        engine._observe_backend = failing_observe

        async def run():
            outs = []
            async for out in engine.submit("r", [1, 2, 3], SamplingParams(max_tokens=16, ignore_eos=True)):
                outs.append(out)
            return outs

        with caplog.at_level(logging.ERROR):
            outs = asyncio.run(run())
        last = outs[-1]
        assert last["finish_reason"] == "abort"
        assert "RuntimeError: CUDA out of memory (injected)" in last["error"]
        assert sum(len(o["token_ids"]) for o in outs) == 4  # the tokens before the failure were streamed
        failed = [r for r in caplog.records if "loop failed" in r.getMessage()]
        assert failed and failed[0].levelno == logging.ERROR and failed[0].exc_info is not None
        assert engine.health()["maintenance"] == "failed"
    finally:
        engine.shutdown()

"""The model thread's step loop: schedule -> launch -> collect -> postprocess, with decode overlap (the
next decode step launched before the one in flight has its tokens on the host), the inbox drained between
steps, and the per-step metrics and backend observations.

StepLoop is a part of Engine (engine.py, its base class): it runs on the model thread alone and reads and
sets the engine's own state (the inbox under ``_cond``, the scheduler, the runner, the step in flight)."""

from __future__ import annotations

import time

from services.common.logging import get_logger
from services.engine.config import DecodeOverlap
from services.engine.engine_status import THROUGHPUT_WINDOW_S
from services.engine.runtime.scheduler import FinishReason, Request

log = get_logger("engine")


class StepLoop:
    """The model thread's loop over steps: the serving side of Engine."""


    def _loop(self) -> None:
        while True:
            with self._cond:
                while (not self._inbox and not self.scheduler.has_work() and self._inflight is None
                       and not self._stop):
                    self._cond.wait()
                if self._stop:
                    break
                items = list(self._inbox)
                self._inbox.clear()
                for item in items:  # adds go to the waiting queue under the lock (exact 429 accounting)
                    if item[0] == "add":
                        self.scheduler.waiting.append(item[1])
            if items:
                self.drain()  # calls and aborts meet a model with nothing in flight
            for item in items:
                if item[0] == "abort":
                    self._abort(*item[1:])
                elif item[0] == "call":
                    _, fn, done = item
                    try:
                        done(fn(), None)
                    except Exception as exc:
                        done(None, exc)
            if any(item[0] == "abort" for item in items):
                self._observe_queues()  # no step may follow (all gone): the gauges must not stay stale
            self.step()
        self.drain()
        self.scheduler.abort_all("shutdown")

    def _abort(self, request_id: str, reason: str = "abort", error: str | None = None) -> None:
        """Drop a request. ``reason`` "stop": the gateway ended it on a stop string, a normal finish
        (counted as finished with reason stop); "abort": the client went away or asked, or ``error`` says
        why the engine failed it (the gateway answers with that message)."""
        req = self.scheduler.abort(request_id, error)
        if req is None:
            return
        if reason == "stop":
            self._totals["requests_finished"] += 1
        else:
            self._totals["requests_aborted"] += 1
        self.metrics.observe_request_finished(time.monotonic() - req.arrival_time, reason)

    def _observe_queues(self) -> None:
        sched = self.scheduler.stats()
        self.metrics.observe_step(sched["running"], sched["waiting"], sched["kv_usage"])

    def step(self) -> None:
        """Launch the next forward, then finish the one before it (tokens to the host, stop checks, streams).

        Decode overlap: while the device computes step N, step N+1 of the same requests is launched with
        step N's samples as its input ids, still on the device (Scheduler.continue_batch), and only then
        are step N's tokens read. The host's per-token work (postprocess, metrics, the API thread's
        streaming) then runs while the device computes, instead of between two steps."""
        done = self._inflight
        if done is None:
            batch = self.scheduler.schedule()
            if batch is None:
                return
            done = self._launch(batch)
            if done is None:
                return
        chained = self.scheduler.continue_batch(done.batch) if self._may_chain(done) else None
        self._inflight = self._launch(chained, after=done) if chained is not None else None
        self._totals["chained_steps"] += self._inflight is not None
        self._finish(done)
        if self._recapture:  # `auto` swapped its backend: the graphs replay the old one's buffers
            self.drain()
            self.runner.recapture()
            self._recapture = False

    def drain(self) -> None:
        """Finish the step still in flight, if any (before calls, aborts and shutdown see the model)."""
        while self._inflight is not None:
            done, self._inflight = self._inflight, None
            self._finish(done)

    def _may_chain(self, done) -> bool:
        overlap = self.config.decode_overlap
        if overlap == DecodeOverlap.OFF or self._inbox or self._recapture or not done.rows:
            return False  # the inbox's calls and aborts want a quiet model: they are served first
        if getattr(self.backend, "may_rebuild", False):  # `auto` before its verdict: observing a step may
            return False  # free buffers and stop the CPU executor that a step in flight still waits on
        return overlap == DecodeOverlap.ON or self.runner.can_replay(len(done.rows))

    def _launch(self, batch, after=None):
        """runner.launch, or None after aborting the batch's requests when it fails."""
        try:
            return self.runner.launch(batch, after)
        except Exception as exc:
            self._forward_failed(batch, exc)
            return None

    def _forward_failed(self, batch, exc: Exception) -> None:
        """Fail the requests a failed step most likely failed for: its prompt chunks when it has any (their
        activations and attention are what grows with a prompt; the decode rows computed nothing this step
        and simply run again in the next), else every row. Their blocks go back at once."""
        failed = batch.requests[:batch.num_prefill] or batch.requests
        if type(exc).__name__ == "OutOfMemoryError":
            tokens = sum(batch.query_lens[:batch.num_prefill])
            why = (f"out of GPU memory in a step of {batch.num_tokens} tokens ({tokens} of them prompt tokens); "
                   "retry, or lower --max-prefill-tokens / --kv-cache-memory")
            log.error("forward failed: %s; failing %d request(s), the others go on", why, len(failed))
            import torch
            torch.cuda.empty_cache()  # the failed step's blocks of the caching allocator, back to the budget
        else:
            why = f"the engine failed this request's step ({type(exc).__name__}: {exc})"
            log.exception("forward failed for %d requests; failing %d of them", len(batch.requests), len(failed))
        for req in failed:  # each stream ends with finish_reason "abort" and the error (the gateway: 500)
            self._abort(req.request_id, error=why)
        self._observe_queues()

    def _finish(self, done) -> None:
        batch = done.batch
        try:
            # a launched step's tokens on the host: the step is over (sleeping while a chained one is queued)
            token_ids = self.runner.collect(done, sleep=self._inflight is not None)
        except Exception as exc:
            self._forward_failed(batch, exc)
            return
        finished_at = time.perf_counter()
        # a chained step's time starts when the one before it ended: the period between two steps' tokens
        seconds = finished_at - max(done.launched_at, self._last_step_end)
        self._last_step_end = finished_at
        if batch.num_prefill == 0:
            self._totals["decode_steps"] += 1
            self._totals["decode_step_seconds"] += seconds
        prev = [r.last_token_time for r in batch.requests]
        # a request can end before its step does: aborted, or stopped by the step a chained one came after
        ended = [r.finish_reason is not None for r in batch.requests]
        self.scheduler.postprocess(batch, token_ids, self.runner.logprobs_of(done))
        now = time.monotonic()
        generated = sum(t is not None for t in token_ids)
        self._window.append((now, generated))
        while self._window[0][0] < now - THROUGHPUT_WINDOW_S:  # pruned here, on the model thread only
            self._window.popleft()
        self._totals["steps"] += 1
        self._totals["tokens_generated"] += generated
        m = self.metrics
        sched = self.scheduler.stats()
        m.observe_step(sched["running"], sched["waiting"], sched["kv_usage"],
                       prompt_tokens=batch.num_tokens - (len(batch.requests) - batch.num_prefill),
                       generation_tokens=generated, cached_tokens=batch.cached_tokens,
                       preemptions_total=sched["preemptions"])
        for req, last, tok, was_over in zip(batch.requests, prev, token_ids, ended):
            if tok is None or was_over:  # a prompt chunk (no token yet), or a token postprocess dropped
                continue
            if last is None:
                m.observe_first_token(now - req.arrival_time)
            else:
                m.observe_inter_token(now - last)
            if req.finish_reason is not None and req.finish_reason != FinishReason.ABORT:
                self._finished(req, now)
        self._observe_backend(batch, seconds)

    def _observe_backend(self, batch, seconds: float) -> None:
        """Step times feed hybrid's per-bucket split and `auto`'s online verdict (decode steps); a rebuilt
        backend needs new decode graphs. Steps with prompt tokens feed the split of their own bucket."""
        if batch.num_prefill:
            observe_prefill = getattr(self.backend, "observe_prefill_step", None)
            if observe_prefill is not None:
                observe_prefill(seconds, batch.num_tokens)
            return
        observe = getattr(self.backend, "observe_decode_step", None)
        if observe is not None and observe(seconds, len(batch.requests)):
            self._recapture = True

    def _finished(self, req: Request, now: float) -> None:
        self._totals["requests_finished"] += 1
        total = now - req.arrival_time
        ttft = (req.first_token_time or now) - req.arrival_time
        n = len(req.output_token_ids)
        self.metrics.observe_request_finished(total, req.finish_reason.value)
        log.debug("request %s: %d prompt + %d completion tokens, finish %s, ttft %.3f s, %.3f s, %.1f tok/s",
                  req.request_id, len(req.prompt_token_ids), n, req.finish_reason.value, ttft, total,
                  (n - 1) / max(total - ttft, 1e-9) if n > 1 else 0.0)

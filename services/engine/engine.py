"""The engine: loads the model, then runs the step loop (schedule -> launch -> collect -> postprocess) on one thread.

The asyncio side (engine API, or the gateway's in-process client under `tandem serve`) talks to the
model thread through two things only: ``submit`` (validated at once, raises for 400/429/503, queued in
an inbox) returning a ``RequestStream`` fed with ``loop.call_soon_threadsafe``, and ``abort``.
The model, the KV cache and the scheduler are touched by the model thread alone.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections import deque
from typing import Any, Callable

from services.common.logging import get_logger
from services.engine.config import DecodeOverlap, EngineConfig
from services.engine.metrics import EngineMetrics
from services.engine.reports import build_info, flat_backend_stats, vram_stats
from services.engine.runtime.grammar import GrammarCompiler, TokenMasks
from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import (FinishReason, InvalidRequestError, QueueFullError, Request,
                                               RequestTooLongError, Scheduler)

log = get_logger("engine")

THROUGHPUT_WINDOW_S = 10.0
STATS_TIMEOUT_S = 30.0  # a step never takes this long; past it the stats come without device counters


class Maintenance(str, enum.Enum):
    LOADING = "loading"
    SERVING = "serving"
    RELOADING = "reloading"
    FAILED = "failed"


class EngineNotReadyError(RuntimeError):
    """The model is still loading (or failed to load); the API answers 503."""


class RequestStream:
    """Async iterator over one request's outputs (dicts of the engine API's NDJSON stream).

    Outputs queued while the consumer was busy are merged into one (token ids concatenated), so a slow
    client never makes the queue grow by more than one item per step."""

    def __init__(self, engine: "Engine", request_id: str, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[dict] = asyncio.Queue()

    def put(self, out: dict) -> None:
        """Called on the model thread."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, out)
        except RuntimeError:  # the event loop is closed: nobody listens any more
            pass

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> dict:
        if self.finished:
            raise StopAsyncIteration
        out = await self._queue.get()
        while not out["finish_reason"] and not self._queue.empty():
            nxt = self._queue.get_nowait()
            nxt["token_ids"] = out["token_ids"] + nxt["token_ids"]
            if "logprobs" in out:
                nxt["logprobs"] = out["logprobs"] + nxt.get("logprobs", [])
            out = nxt
        self.finished = out["finish_reason"] is not None
        return out

    def abort(self) -> None:
        """Abort unless already finished (idempotent); frees the KV slot on the next engine step."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class Engine:
    """Owns the model thread. ``start()`` returns at once; ``health()`` reports the loading progress.

    Why one class (~400 lines) and not one per responsibility (lifecycle, step loop, API side, reports):
    the four meet in the one piece of state that makes the engine thread-safe, the inbox under ``_cond``
    that only the model thread drains. ``submit``/``abort``/``call`` append to it, the step loop drains
    it between steps, loading and reloading switch ``maintenance`` under it, and the reports read the
    device through ``call``. Split into classes, each would hold a reference to that inbox and to the
    others' state, and the rule "the model, the KV cache and the scheduler are touched by the model
    thread alone" would no longer be visible in one place. What does not touch it already lives apart:
    scheduling (runtime/scheduler.py), the forward and graphs (runtime/runner.py), the stats' shape
    (reports.py), metrics (metrics.py), the HTTP side (api.py)."""

    def __init__(self, config: EngineConfig, load: Callable[..., Any] | None = None,
                 on_ready: Callable[[], None] | None = None):
        """``load`` defaults to the model registry's load_model; ``on_ready`` runs once serving starts."""
        self.config = config
        self._on_ready = on_ready
        # Runs on the model thread once loading failed (``error`` says why): the CLI stops its server.
        self.on_load_failed: Callable[[], None] | None = None
        self.maintenance = Maintenance.LOADING
        self.progress: dict = {}
        self.error: str | None = None
        self.loaded = None
        self.runner = None
        self.scheduler: Scheduler | None = None
        self.grammars: GrammarCompiler | None = None  # compiles requests' grammars (constrained decoding)
        self.metrics = None  # EngineMetrics (services/engine/metrics.py) once the model id is known
        self._info: dict | None = None
        self._load = load
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._live: set[str] = set()  # request ids submitted and not finished (abort is by id)
        self._stop = False
        self._thread: threading.Thread | None = None
        self._window: deque[tuple[float, int]] = deque()  # (time, tokens generated in that step)
        self._inflight = None  # the step launched and not finished yet (runner.LaunchedStep), decode overlap
        self._last_step_end = 0.0  # perf_counter when the last step's tokens reached the host
        self._recapture = False  # the backend was rebuilt: capture the decode graphs again once drained
        # decode_step_seconds over decode_steps: from a step's launch (or, chained, the step before it
        # ending) to its tokens on the host; a client's time per token beyond it is the serving path's own
        self._totals = {"requests_finished": 0, "requests_aborted": 0, "tokens_generated": 0, "steps": 0,
                        "decode_steps": 0, "decode_step_seconds": 0.0, "chained_steps": 0}
        self.started_at = time.time()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="tandem-model", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self.runner is not None and (self._thread is None or not self._thread.is_alive()):
            self.runner.close()  # its compile watch (process-wide hooks), once the model thread is done with it

    def wait_ready(self, timeout_s: float) -> None:
        """Block until serving (for tests and `tandem serve`); raise if loading failed or timed out."""
        deadline = time.monotonic() + timeout_s
        while self.maintenance == Maintenance.LOADING and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.maintenance == Maintenance.FAILED:
            raise RuntimeError(f"engine failed to load {self.config.model!r}: {self.error}")
        if self.maintenance == Maintenance.LOADING:
            raise TimeoutError(f"engine still loading {self.config.model!r} after {timeout_s:.0f} s")

    def _main(self) -> None:
        try:
            self._load_model()
        except Exception as exc:  # reported through /health and on_load_failed (`tandem engine`/`serve` exit)
            if isinstance(exc, ValueError):  # bad input (LoaderError, a cache too small...): the message says it all
                log.error("cannot serve %s: %s", self.config.model, exc)
            else:
                log.exception("loading %s failed", self.config.model)
            self.error = f"{type(exc).__name__}: {exc}"
            self.maintenance = Maintenance.FAILED
            if self.on_load_failed is not None:
                self.on_load_failed()
            return
        self.maintenance = Maintenance.SERVING
        log.info("ready: model %s, backend %s, %d slots x %d tokens, decode overlap %s", self.loaded.model_id,
                 self.config.moe_backend.value, self.config.max_running_requests, self.config.max_seq_len,
                 self.config.decode_overlap.value)
        if self._on_ready is not None:
            self._on_ready()
        try:
            self._loop()
        except Exception as exc:  # a bug in the step loop: say so on /health instead of hanging requests
            log.exception("the model thread's loop failed; the engine stops serving")
            self.error = f"{type(exc).__name__}: {exc}"
            self.maintenance = Maintenance.FAILED
            with self._cond:
                pending = list(self._inbox)
                self._inbox.clear()
            for item in pending:
                if item[0] == "call":
                    item[2](None, EngineNotReadyError(f"engine failed: {self.error}"))
                elif item[0] == "add":
                    self.scheduler.waiting.append(item[1])
            self.scheduler.abort_all("failed")

    def _load_model(self) -> None:
        import torch

        from services.engine.runtime.runner import ModelRunner

        load = self._load
        if load is None:
            from services.engine.models.registry import load_model as load
        cfg = self.config
        log.info("loading %s on %s (%s, backend %s)", cfg.model, cfg.device.value, cfg.dtype.value,
                 cfg.moe_backend.value)
        t0 = time.monotonic()
        self.loaded = load(cfg, progress=self._on_progress)
        self._info = build_info(self.loaded, cfg.max_seq_len, cfg.served_model_names)
        pages = self._info["moe"]["host_pages"]
        if pages and pages["bytes"]:  # none where the banks live on the device (resident synthetic)
            log.info("host banks: %.1f GB in %d mappings, %.1f GB of it in transparent huge pages (THP %s)",
                     pages["bytes"] / 1e9, pages["regions"], pages["huge_page_bytes"] / 1e9, pages["thp"])
        self.metrics = EngineMetrics(self.loaded.model_id)
        device = torch.device(cfg.device.value)
        dtype = getattr(torch, cfg.dtype.value)
        self.grammars = GrammarCompiler(self._info["tokenizer_json"], self.loaded.spec.vocab_size,
                                        self._info["eos_token_ids"])
        self.grammars.warm_in_background()
        self.runner = ModelRunner(self.loaded, cfg.max_running_requests, cfg.max_seq_len, device, dtype,
                                  backend_name=cfg.moe_backend.value, eos_token_ids=self._info["eos_token_ids"],
                                  masks=TokenMasks(self.grammars.mask_vocab), progress=self._on_progress,
                                  batch_invariant=cfg.batch_invariant)
        self.scheduler = Scheduler(cfg.max_running_requests, cfg.max_waiting_requests, cfg.max_seq_len,
                                   self._info["eos_token_ids"], max_prefill_tokens=cfg.max_prefill_tokens,
                                   prefix_cache=cfg.prefix_cache, one_prompt_per_step=cfg.batch_invariant)
        log.info("loaded %s in %.1f s", self.loaded.model_id, time.monotonic() - t0)

    def _on_progress(self, progress: dict) -> None:
        self.progress = dict(progress)

    # -- the model thread's loop ---------------------------------------------------------------
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

    def _abort(self, request_id: str, reason: str = "abort") -> None:
        """Drop a request. ``reason`` "stop": the gateway ended it on a stop string, a normal finish
        (counted as finished with reason stop); "abort": the client went away or asked."""
        req = self.scheduler.abort(request_id)
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
        except Exception:
            self._forward_failed(batch)
            return None

    def _forward_failed(self, batch) -> None:
        log.exception("forward failed for %d requests; aborting them", len(batch.requests))
        for req in batch.requests:  # each stream ends with finish_reason "abort" (the gateway: 500)
            self._abort(req.request_id)
        self._observe_queues()

    def _finish(self, done) -> None:
        batch = done.batch
        try:
            # a launched step's tokens on the host: the step is over (sleeping while a chained one is queued)
            token_ids = self.runner.collect(done, sleep=self._inflight is not None)
        except Exception:
            self._forward_failed(batch)
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
                       generation_tokens=generated, cached_tokens=batch.cached_tokens)
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

    async def refresh_metrics(self) -> None:
        """Export the expert backend's cumulative counters (called at scrape time, GET /metrics)."""
        if self.metrics is not None:
            experts = await self._device_stats()
            self.metrics.record_backend_stats(experts.get("experts", {}))

    async def _device_stats(self) -> dict:
        """Backend counters and VRAM, read on the model thread between two steps: a CUDA call from
        another thread could land inside a graph capture or race a replay. {} unless serving."""
        if self.maintenance not in (Maintenance.SERVING, Maintenance.RELOADING):
            return {}

        def read() -> dict:
            backend = self.backend
            vram = vram_stats(self.config)
            raw = backend.stats() if backend is not None and hasattr(backend, "stats") else {}
            return {"experts": flat_backend_stats(raw),
                    "vram": vram, "vram_gib": vram["allocated_bytes"] / 2**30 if vram else None}

        try:
            return await asyncio.wait_for(self.call(read), STATS_TIMEOUT_S)
        except (asyncio.TimeoutError, EngineNotReadyError):
            return {}

    # -- API side (any thread / the event loop) ------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; must be called on the event loop that will consume the stream.

        Raises EngineNotReadyError (503), RequestTooLongError (400), QueueFullError (429)."""
        if self.maintenance in (Maintenance.LOADING, Maintenance.FAILED) or self.scheduler is None:
            raise EngineNotReadyError(f"engine is {self.maintenance.value}" + (f": {self.error}" if self.error else ""))
        vocab = self.loaded.spec.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt_token_ids has ids outside [0, {vocab}): {bad[:5]}")
        bad = [t for t in params.logit_bias if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias has token ids outside [0, {vocab}): {bad[:5]}")
        self.scheduler.check(len(prompt_token_ids), params)
        # compiled here, on the caller's thread: a grammar that does not compile is a 400 before queueing
        grammar = self.grammars.compile(params.grammar) if params.grammar is not None else None
        stream = RequestStream(self, request_id, asyncio.get_running_loop())

        def emit(out: dict) -> None:  # model thread: forward to the stream, forget the id when done
            if out["finish_reason"] is not None:
                with self._cond:
                    self._live.discard(request_id)
            stream.put(out)

        req = Request(request_id, list(prompt_token_ids), params, emit, grammar=grammar)
        with self._cond:
            if request_id in self._live:
                raise InvalidRequestError(f"request_id {request_id!r} is already in flight; ids must be unique")
            queued = len(self.scheduler.waiting) + sum(1 for it in self._inbox if it[0] == "add")
            if queued >= self.config.max_waiting_requests:
                raise QueueFullError(f"waiting queue full ({self.config.max_waiting_requests} requests, "
                                     f"--max-waiting-requests); retry later")
            self._live.add(request_id)
            self._inbox.append(("add", req))
            self._cond.notify()
        return stream

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Drop a request on the model thread; ``reason`` "stop" when the gateway's stop string ended it."""
        if reason not in ("abort", "stop"):
            raise ValueError(f"finish_reason of an abort must be 'abort' or 'stop', got {reason!r}")
        with self._cond:
            self._inbox.append(("abort", request_id, reason))
            self._cond.notify()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the model thread between two steps and await its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(result, exc):
            def settle():
                if not fut.done():
                    fut.set_exception(exc) if exc else fut.set_result(result)
            loop.call_soon_threadsafe(settle)

        with self._cond:
            if self.maintenance in (Maintenance.LOADING, Maintenance.FAILED):
                raise EngineNotReadyError(f"engine is {self.maintenance.value}; the model thread takes no calls")
            self._inbox.append(("call", fn, done))
            self._cond.notify()
        return await fut

    async def reload_profile(self) -> dict:
        """Ask the expert backend to re-read its bandwidth profile (between two steps, no restart)."""
        if self.maintenance != Maintenance.SERVING:
            raise EngineNotReadyError(f"engine is {self.maintenance.value}; cannot reload the profile now")

        def reload():
            backend = self.backend
            fn = getattr(backend, "reload_profile", None)
            if fn is None:
                return {"reloaded": False, "backend": self.config.moe_backend.value,
                        "reason": f"backend {self.config.moe_backend.value} does not use a bandwidth profile"}
            self.maintenance = Maintenance.RELOADING
            try:
                result = fn()
                if isinstance(result, dict) and result.get("rebuilt"):
                    self.runner.recapture()  # the old decode graphs replay the old backend's buffers
            finally:
                self.maintenance = Maintenance.SERVING
            return {"reloaded": True, "backend": self.config.moe_backend.value,
                    **(result if isinstance(result, dict) else {})}

        return await self.call(reload)

    # -- reports -----------------------------------------------------------------------------
    @property
    def backend(self):
        """The expert backend of the loaded model (LoadedModel.backend, else found on the model)."""
        if self.loaded is None:
            return None
        backend = getattr(self.loaded, "backend", None)
        if backend is None:
            backend = getattr(self.loaded.model, "backend", None)
        return backend

    def health(self) -> dict:
        if self.maintenance == Maintenance.LOADING:
            return {"status": "loading", "progress": self.progress, "model": self.config.model}
        out = {"status": "ok", "maintenance": self.maintenance.value, "model": self.config.model,
               "backend": self.config.moe_backend.value}
        if self.loaded is not None:
            out["model_id"] = self.loaded.model_id
        if self.error:
            out["error"] = self.error
        return out

    def info(self) -> dict:
        if self._info is None:
            raise EngineNotReadyError(f"engine is {self.maintenance.value}; info is known once the model is loaded")
        return self._info

    async def stats(self) -> dict:
        """GET /engine/v1/stats: throughput over the window, requests, KV use, expert counters, VRAM."""
        now = time.monotonic()
        window = list(self._window)  # one atomic copy: the model thread appends concurrently
        tokens = sum(n for t, n in window if t >= now - THROUGHPUT_WINDOW_S)
        out: dict[str, Any] = {"maintenance": self.maintenance.value, "moe_backend": self.config.moe_backend.value,
                               "model": self.config.model, "uptime_s": time.time() - self.started_at,
                               "throughput_window_s": THROUGHPUT_WINDOW_S,
                               "generation_tokens_per_s": tokens / THROUGHPUT_WINDOW_S, **self._totals}
        if self.scheduler is not None:
            out.update(self.scheduler.stats())
        if self.runner is not None:
            out.update(self.runner.stats())
        out.update({"experts": {}, "vram": None, "vram_gib": None, **(await self._device_stats())})
        out["expert_cache"] = out["experts"]  # older name (tests/deploy reads it); "experts" is the one to use
        return out


__all__ = ["Engine", "EngineNotReadyError", "InvalidRequestError", "Maintenance", "QueueFullError", "RequestStream",
           "RequestTooLongError"]

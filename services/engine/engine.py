"""The engine: loads the model, then runs the step loop (schedule -> launch -> collect -> postprocess) on one thread.
This file: the engine's state, loading, start/stop and the API side (admission); the step loop is in
step_loop.py, health/info/stats in engine_status.py.

The asyncio side (engine API, or the gateway's in-process client under `tandem serve`) talks to the
model thread through two things only: ``submit`` (validated at once, raises for 400/429/503, queued in
an inbox) returning a ``RequestStream`` fed with ``loop.call_soon_threadsafe``, and ``abort``.
The model, the KV cache and the scheduler are touched by the model thread alone.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from collections import deque
from typing import Any, Callable

from services.common.logging import get_logger
from services.engine.config import EngineConfig
from services.engine.engine_status import EngineNotReadyError, EngineStatus, Maintenance
from services.engine.metrics import EngineMetrics
from services.engine.reports import build_info
from services.engine.runtime.block_manager import BlockManager
from services.engine.runtime.grammar import GrammarCompiler, TokenMasks
from services.engine.runtime.kv_budget import decide_kv_budget, resolve_max_seq_len
from services.engine.runtime.routing_trace import RoutingRecorder
from services.engine.runtime.sampler import SamplingParams
from services.engine.runtime.scheduler import (InvalidRequestError, QueueFullError, Request, RequestTooLongError,
                                               Scheduler)
from services.engine.step_loop import StepLoop

log = get_logger("engine")


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


class Engine(StepLoop, EngineStatus):
    """Owns the model thread. ``start()`` returns at once; ``health()`` reports the loading progress.

    Why one object and not one per responsibility (lifecycle, step loop, API side, reports): the four
    meet in the one piece of state that makes the engine thread-safe, the inbox under ``_cond`` that
    only the model thread drains. ``submit``/``abort``/``call`` append to it, the step loop drains it
    between steps, loading and reloading switch ``maintenance`` under it, and the reports read the
    device through ``call``. Split into objects, each would hold a reference to that inbox and to the
    others' state. So the methods live in three files (this one, step_loop.py's StepLoop and
    engine_status.py's EngineStatus, its base classes) but share the one state, all of it created in
    ``__init__`` here, where the rule "the model, the KV cache and the scheduler are touched by the
    model thread alone" stays visible. What does not touch it lives apart: scheduling
    (runtime/scheduler.py), the forward and graphs (runtime/runner.py), the stats' shape (reports.py),
    metrics (metrics.py), the HTTP side (api.py)."""

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
        self.kv_budget = None  # runtime/kv_budget.KVBudget: the paged KV pool's size and why
        self.grammars: GrammarCompiler | None = None  # compiles requests' grammars (constrained decoding)
        self.metrics = None  # EngineMetrics (services/engine/metrics.py) once the model id is known
        self._info: dict | None = None
        self._load = load
        self._cond = threading.Condition()
        self._inbox: deque[tuple] = deque()
        self._backend_refreshed_at = float("-inf")  # last scrape that read the backend's counters
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
            if self.loaded.model.recorder is not None:
                self.loaded.model.recorder.close()

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
        log.info("ready: model %s, backend %s, %d running requests, context %d tokens, KV pool %d tokens, "
                 "decode overlap %s", self.loaded.model_id, self.config.moe_backend.value,
                 self.config.max_running_requests, self.config.max_seq_len,
                 self.kv_budget.tokens, self.config.decode_overlap.value)
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
            # each stream's last output says why (the gateway's error event), not a bare "aborted"
            self.scheduler.abort_all("failed", f"the engine failed and stops serving ({self.error})")

    def _load_model(self) -> None:
        import torch

        from services.engine.runtime.runner import ModelRunner

        load = self._load
        if load is None:
            from services.engine.models.registry import load_model as load
        cfg = self.config
        log.info("loading %s on %s (%s, backend %s)", cfg.model, cfg.device.value, cfg.dtype.value,
                 cfg.moe_backend.value)
        if cfg.device.value == "cuda" and cfg.gpu_memory_limit is not None:
            # the limit bounds every allocation of the engine, not just the sizing: past it torch raises an
            # out-of-memory (which fails one request, step_loop.py) instead of taking more of a shared card
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.gpu_memory_limit * (1 << 30) / total))
        t0 = time.monotonic()
        self.loaded = load(cfg, progress=self._on_progress)
        self._info = build_info(self.loaded, resolve_max_seq_len(cfg, self.loaded.spec), cfg.served_model_names)
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
        budget = self.kv_budget = decide_kv_budget(cfg, self.loaded.spec, dtype)
        log.info("KV cache: %s", budget.describe())
        blocks = BlockManager(budget.num_blocks, budget.block_size, cfg.max_running_requests, cfg.max_seq_len,
                              cfg.prefix_cache)
        if cfg.record_routing:
            spec = self.loaded.spec
            self.loaded.model.set_recorder(RoutingRecorder(Path(cfg.record_routing), self.loaded.model_id,
                                                           spec.num_moe_layers, spec.num_experts, spec.top_k,
                                                           int(cfg.record_routing_max_gb * 1e9)))
        self.runner = ModelRunner(self.loaded, cfg.max_running_requests, cfg.max_seq_len, device, dtype,
                                  backend_name=cfg.moe_backend.value, eos_token_ids=self._info["eos_token_ids"],
                                  masks=TokenMasks(self.grammars.mask_vocab), progress=self._on_progress,
                                  batch_invariant=cfg.batch_invariant, blocks=blocks)
        self.scheduler = Scheduler(cfg.max_running_requests, cfg.max_waiting_requests, cfg.max_seq_len,
                                   self._info["eos_token_ids"], max_prefill_tokens=cfg.max_prefill_tokens,
                                   one_prompt_per_step=cfg.batch_invariant, blocks=blocks)
        log.info("loaded %s in %.1f s", self.loaded.model_id, time.monotonic() - t0)

    def _on_progress(self, progress: dict) -> None:
        self.progress = dict(progress)

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
            if self._queued() >= self.config.max_waiting_requests:
                raise QueueFullError(f"waiting queue full ({self.config.max_waiting_requests} requests, "
                                     f"--max-waiting-requests); retry later")
            self._live.add(request_id)
            self._inbox.append(("add", req))
            self._cond.notify()
        return stream

    def _queued(self) -> int:
        """Requests not yet in the running batch: the scheduler's queue and those still in the inbox
        (call with ``_cond`` held)."""
        waiting = len(self.scheduler.waiting) if self.scheduler is not None else 0
        return waiting + sum(1 for it in self._inbox if it[0] == "add")

    def waiting_now(self) -> int:
        """The waiting requests at this instant, from any thread (what tandem_num_requests_waiting means)."""
        with self._cond:
            return self._queued()

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


__all__ = ["Engine", "InvalidRequestError", "QueueFullError", "RequestStream", "RequestTooLongError"]

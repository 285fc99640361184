"""One text generation through an engine: token ids from the engine -> text deltas for the client.

Shared by chat and completions: builds the engine's ``sampling`` object (request values, else the
model's generation_config defaults), routes to an engine, detokenizes incrementally, applies stop
strings (never streaming any part of one) and counts usage. Aborts the engine request when the client
goes away or a stop string matched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import AsyncIterator

from services.common.logging import get_logger
from services.common.tokenizer import StopStringMatcher
from services.gateway.engines import EngineError, EnginePool, EngineState, new_request_id
from services.gateway.metrics import GatewayMetrics
from services.gateway.protocol import error_body
from services.gateway.reasoning import harmony_splitter

log = get_logger("gateway.generation")


class RequestError(Exception):
    """A client error found by the gateway (HTTP 400 unless told): OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.body = error_body(message, type_, status, param)


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None
    # the tokens that came with this delta, when the request asked for logprobs:
    # {"token_id", "logprob", "top": [[id, logprob], ...]} each (the ids of a delta and its text need not align)
    logprobs: list[dict] = field(default_factory=list)
    reasoning: str = ""  # harmony models: text of the analysis channel (reasoning.py), apart from ``text``
    calls: list = field(default_factory=list)  # harmony models, tools asked for: the calls completed in this delta


@dataclass
class Generation:
    """The state of one request while it streams (usage is final once a finish_reason was yielded)."""

    engine: EngineState
    prompt_token_ids: list[int]
    sampling: dict
    stop: list[str]
    index: int = 0  # the choice's index (n > 1)
    request_id: str = field(default_factory=new_request_id)
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache
    finish_reason: str | None = None
    text: str = ""
    logprobs: list[dict] | None = None  # every token's entry (as Delta.logprobs) when asked
    # False when a special token is part of the answer's syntax (Mistral's [TOOL_CALLS]: chat_tools.py)
    skip_special_tokens: bool = True
    reasoning: str = ""  # harmony models: the analysis channel's text (reasoning_content)
    # harmony models with tools: turns a call message's (name, body) into a ToolCall, None if malformed
    # (tool_parsers.HarmonyToolParser.call_from_body); None: calls are not parsed, their bodies are text
    make_call: Callable[[str, str], object | None] | None = None
    calls: list = field(default_factory=list)  # the calls so far (make_call's)
    stop_string: str | None = None  # the stop string that ended the text, if one did
    pool: EnginePool | None = None  # set by start(): its shutdown ends this generation

    def choices(self, n: int) -> list["Generation"]:
        """This generation and n - 1 more of the same prompt (choices 0..n-1), each its own engine request.
        With a seed, choice i draws with seed + i: reproducible, and different from its siblings."""
        out = [self]
        for i in range(1, n):
            sampling = dict(self.sampling)
            if sampling.get("seed") is not None:
                sampling["seed"] = sampling["seed"] + i
            out.append(Generation(self.engine, self.prompt_token_ids, sampling, self.stop, index=i,
                                  skip_special_tokens=self.skip_special_tokens, make_call=self.make_call))
        return out

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


def sampling_from_request(req, engine: EngineState, max_tokens: int | None) -> dict:
    """The engine's sampling object: request values first, then generation_config's defaults."""
    from services.gateway.sampling import extra_sampling  # it raises this module's RequestError

    gen_cfg = (engine.info or {}).get("generation_config") or {}
    temperature = req.temperature if req.temperature is not None else gen_cfg.get("temperature", 1.0)
    if not gen_cfg.get("do_sample", True) and req.temperature is None:
        temperature = 0.0
    top_p = req.top_p if req.top_p is not None else gen_cfg.get("top_p", 1.0)
    top_k = req.top_k if req.top_k is not None else gen_cfg.get("top_k", -1)
    if max_tokens is None:  # chat without a limit: what is left of the context (as vLLM does)
        max_tokens = int((engine.info or {}).get("max_seq_len", 0))
    return {"max_tokens": max_tokens, "temperature": float(temperature), "top_p": float(top_p),
            "top_k": int(top_k) if top_k else -1, "seed": req.seed, "ignore_eos": bool(req.ignore_eos),
            "stop_token_ids": [], **extra_sampling(req, gen_cfg, engine.tokenizer.vocab_size)}


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if len(stops) > 4:
        raise RequestError("stop may hold at most 4 sequences", "stop")
    return [s for s in stops if s]


def fit_max_tokens(engine: EngineState, prompt_len: int, max_tokens: int | None, explicit: bool) -> int:
    """max_tokens for the engine: an implicit limit shrinks to the context left; an explicit one that
    does not fit is refused with a message naming the model's limit."""
    limit = int((engine.info or {}).get("max_seq_len", 0))
    if max_tokens is None or (not explicit and prompt_len + max_tokens > limit):
        max_tokens = limit - prompt_len
    if max_tokens < 1 or prompt_len + max_tokens > limit:
        raise RequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max(max_tokens, 0)} tokens ({prompt_len} in the prompt, {max(max_tokens, 0)} for the "
            f"completion). Please reduce the length of the prompt or max_tokens.", "max_tokens")
    return max_tokens


def refuse_overlong_prompt(engine: EngineState, prompt: str, param: str) -> None:
    """Before tokenizing (seconds of CPU and hundreds of MB for a 4 MB prompt): a prompt that cannot
    fit the context whatever it tokenizes to (more characters than max_seq_len tokens can cover) is
    refused at once, naming both limits."""
    limit = int((engine.info or {}).get("max_seq_len", 0))
    most = limit * engine.tokenizer.max_token_chars
    if len(prompt) > most:
        raise RequestError(f"This model's maximum context length is {limit} tokens, at most {most} characters of "
                           f"prompt; the prompt has {len(prompt)} characters. Please reduce the length of the "
                           f"prompt.", param)


async def start(pool: EnginePool, gen: Generation):
    """Send the request to its engine; raises EngineError (429/400/503...) before anything streams.
    An engine that cannot be reached (503) is taken out of rotation, and one whose queue is full (429)
    is passed over for this request; either way the request goes to the next healthy engine serving the
    model that it has not tried, if any (else the client gets that error, Retry-After included)."""
    model = gen.engine.model_id
    gen.pool = pool
    tried: set[int] = set()
    for _ in range(len(pool.engines)):
        engine = gen.engine
        tried.add(id(engine))
        engine.outstanding += 1  # before the first await: concurrent requests picked next see it
        GatewayMetrics.set_engine_outstanding(engine.client.id, engine.outstanding)
        try:
            return await engine.client.generate(gen.request_id, gen.prompt_token_ids, gen.sampling)
        except BaseException as exc:
            engine.outstanding -= 1
            GatewayMetrics.set_engine_outstanding(engine.client.id, engine.outstanding)
            if not (isinstance(exc, EngineError) and exc.status in (429, 503)):
                raise
            if exc.status == 503:
                pool.mark_down(engine, str(exc))
            try:
                gen.engine = pool.pick(model, exclude=tried)
            except EngineError:
                if exc.status == 429:
                    raise exc from None  # every engine is full: the client retries after Retry-After
                raise  # 503: no healthy engine is left
            same_tokenizer = gen.engine.info.get("tokenizer_json") == engine.info.get("tokenizer_json")
            if gen.engine.tokenizer is None or not same_tokenizer:
                raise exc from None  # another tokenizer: the prompt ids would not mean the same text
    raise EngineError(503, f"no engine could take the request for `{model}`", "service_unavailable",
                      {"Retry-After": "5"})


async def close(gen: Generation, stream) -> None:
    """Close a started generation that is never read (aborts it on the engine)."""
    gen.engine.outstanding -= 1
    GatewayMetrics.set_engine_outstanding(gen.engine.client.id, gen.engine.outstanding)
    await stream.aclose()


async def deltas(gen: Generation, stream) -> AsyncIterator[Delta]:
    """Text deltas of a started generation; the last one carries the finish_reason. Closing this
    iterator early (client gone) closes the engine stream, which aborts the request there."""
    engine = gen.engine
    detok = engine.tokenizer.detokenizer(skip_special_tokens=gen.skip_special_tokens)
    stops = StopStringMatcher(gen.stop)
    # harmony (gpt-oss): reasoning and calls apart from the answer
    splitter = harmony_splitter(engine.tokenizer, gen.make_call)
    reasoning_detok = engine.tokenizer.detokenizer() if splitter is not None else None
    outputs = EngineOutputs(stream, gen.pool)
    try:
        while (out := await outputs.next()) is not None:
            ids = out.get("token_ids", [])
            logprobs = [{"token_id": t, **e} for t, e in zip(ids, out.get("logprobs", []))]
            gen.completion_tokens = out.get("completion_tokens", gen.completion_tokens + len(ids))
            gen.cached_tokens = out.get("cached_tokens", gen.cached_tokens)
            finish = out.get("finish_reason")
            if finish == "stop" and out.get("stop_token_id") is not None and ids:
                ids = ids[:-1]  # the EOS/stop token ends the text, it is not part of it
                logprobs = logprobs[:len(ids)]
            if gen.sampling.get("logprobs") is not None:
                gen.logprobs = (gen.logprobs or []) + logprobs
            reasoning, calls = "", []
            if splitter is not None:
                parts = splitter.feed(ids)
                if finish is not None:  # the stop token (<|call|>) was dropped above: it ends the last message
                    end = splitter.finish()
                    parts.answer += end.answer
                    parts.calls += end.calls
                reasoning = reasoning_detok.add_many(parts.reasoning)
                if finish is not None:
                    reasoning += reasoning_detok.finish()
                gen.reasoning += reasoning
                ids, calls = parts.answer, parts.calls
                gen.calls += calls
            delta, matched = stops.feed(detok.add_many(ids))
            if not matched and finish is not None:
                if finish == "abort":
                    raise EngineError(500, out.get("error") or "the engine aborted the request")
                tail, matched = stops.feed(detok.finish())
                delta += tail if matched else tail + stops.flush()
            if matched:
                if finish is None:  # still generating there: tell the engine it finished, not aborted
                    await engine.client.abort(gen.request_id, "stop")
                finish = "stop"
                gen.stop_string = stops.stop_string
            if finish is not None:
                gen.finish_reason = finish
                gen.text += delta
                log.debug("request %s on engine %s: %d prompt + %d completion tokens, finish %s", gen.request_id,
                          engine.client.id, gen.prompt_tokens, gen.completion_tokens, finish)
                yield Delta(delta, finish, logprobs, reasoning, calls)
                return
            if delta or logprobs or reasoning or calls:
                gen.text += delta
                yield Delta(delta, logprobs=logprobs, reasoning=reasoning, calls=calls)
    finally:
        outputs.close()  # no await: this task may be under cancellation (client gone)
        engine.outstanding -= 1
        GatewayMetrics.set_engine_outstanding(engine.client.id, engine.outstanding)


class EngineOutputs:
    """The engine stream of one generation, read by a task of its own into a queue.

    That task owns the stream: it closes it (aborting the request on the engine) however the
    generation ends. The consumer's task cannot be trusted to await a close: when the client goes
    away, Starlette cancels it through an anyio cancel scope, which cancels every await again,
    cleanup included. ``close()`` needs no await. The pool can end the generation
    (``EnginePool.end_generations``, shutdown grace over): ``next()`` then raises a 503."""

    _END = object()

    def __init__(self, stream, pool: EnginePool | None):
        self._stream, self._pool = stream, pool
        self._queue: asyncio.Queue = asyncio.Queue()
        self._reader = asyncio.ensure_future(self._read())
        if pool is not None:
            pool.readers.add(self._reader)
            self._reader.add_done_callback(pool.readers.discard)

    async def _read(self) -> None:
        try:
            async for out in self._stream:
                self._queue.put_nowait(out)
            self._queue.put_nowait(self._END)
        except asyncio.CancelledError:
            self._queue.put_nowait(_shutting_down())  # read only when the pool ended it (else nobody waits)
            raise
        except Exception as exc:  # a broken stream (EngineError): raised in the consumer
            self._queue.put_nowait(exc)
        finally:
            await self._stream.aclose()

    async def next(self) -> dict | None:
        """The engine's next output; None at the end of the stream."""
        if self._pool is not None and self._pool.closing and not self._reader.done():
            self._reader.cancel()
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return None if item is self._END else item

    def close(self) -> None:
        self._reader.cancel()


def _shutting_down() -> EngineError:
    return EngineError(503, "the gateway is shutting down and its grace for requests in flight is over; "
                       "retry on another replica or once it is back", "service_unavailable", {"Retry-After": "5"})


async def complete(gen: Generation, stream, is_disconnected=None, poll_s: float = 0.5) -> bool:
    """Run a non-streamed generation to its end (True), or abort it when the client is gone (False).
    ``is_disconnected`` (an async callable, e.g. Starlette's ``request.is_disconnected``) is polled so
    that a client that gave up does not leave the engine decoding to max_tokens."""
    async def drain():
        async for _ in deltas(gen, stream):
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                task.result()  # re-raises an EngineError of the stream
                return True
            if is_disconnected is not None and await is_disconnected():
                log.info("client gone before the end of request %s: aborting it", gen.request_id)
                return False
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

"""POST /v1/completions: a text prompt (or token ids) in, text out; JSON or SSE chunks ending
``data: [DONE]`` (an optional usage chunk before it)."""

from __future__ import annotations

import asyncio
import time

from services.gateway import generation as g
from services.gateway.engines import EnginePool
from services.gateway.request_fields import refuse_unsupported
from services.gateway.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from services.gateway.logprobs import completion_logprobs
from services.gateway.responses import event_stream, respond, sse, usage


def _prompt_ids(req: CompletionRequest, engine) -> list[int]:
    """One prompt only (a string, a list of one string, token ids, or a list of one id list)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise g.RequestError("several prompts in one request are not supported; send one per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise g.RequestError("prompt is empty", "prompt")
        g.refuse_overlong_prompt(engine, p, "prompt")
        return engine.tokenizer.encode(p)
    if not p:
        raise g.RequestError("prompt is empty", "prompt")
    tokenizer = engine.tokenizer
    bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise g.RequestError(f"prompt token ids outside the vocabulary [0, {tokenizer.vocab_size}): {bad[:5]}",
                             "prompt")
    return list(p)


def prepare(pool: EnginePool, req: CompletionRequest) -> g.Generation:
    """Validate and tokenize (CPU-bound: run it in a worker thread)."""
    refuse_unsupported(req)  # first: a refused field is the answer, whatever else is wrong
    engine = pool.pick(req.model)
    ids = _prompt_ids(req, engine)
    explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    max_tokens = g.fit_max_tokens(engine, len(ids), req.max_tokens, explicit=explicit)
    sampling = g.sampling_from_request(req, engine, max_tokens)
    return g.Generation(engine, ids, sampling, g.stop_list(req.stop))


async def create_completion(pool: EnginePool, req: CompletionRequest, is_disconnected=None):
    # off the event loop: templating and tokenizing a long prompt take seconds of CPU
    gens = (await asyncio.to_thread(prepare, pool, req)).choices(req.n or 1)
    tokenizer = gens[0].engine.tokenizer

    def logprobs(gen: g.Generation, entries: list[dict] | None, offset: int = 0) -> dict | None:
        if gen.sampling.get("logprobs") is None:
            return None
        return completion_logprobs(entries or [], tokenizer, offset)

    def body(response_id: str) -> CompletionResponse:
        return CompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**usage(gens)),
                                  choices=[CompletionChoice(index=x.index, text=x.text, logprobs=logprobs(x, x.logprobs),
                                                            finish_reason=x.finish_reason) for x in gens])

    return await respond(pool, gens, req, "cmpl",
                         lambda streams, response_id, include_usage: _stream(
                             gens, streams, req.model, response_id, include_usage, logprobs),
                         body, is_disconnected)


def _stream(gens: list[g.Generation], streams, model: str, response_id: str, include_usage: bool, logprobs):
    created = int(time.time())
    offsets = {x.index: 0 for x in gens}  # text_offset of each choice's next token

    def events_of(gen: g.Generation, d: g.Delta):
        if d.text or d.finish_reason or d.logprobs:
            lp = logprobs(gen, d.logprobs, offsets[gen.index])
            if lp and lp["tokens"]:
                offsets[gen.index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            choice = CompletionChoice(index=gen.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason)
            body = CompletionResponse(id=response_id, created=created, model=model, choices=[choice]).model_dump()
            if not include_usage:
                body.pop("usage")
            yield sse(body)

    def usage_chunk() -> dict:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                  usage=UsageInfo(**usage(gens))).model_dump()

    return event_stream(gens, streams, events_of, usage_chunk if include_usage else None)

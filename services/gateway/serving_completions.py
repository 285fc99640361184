"""POST /v1/completions: a text prompt (or token ids) in, text out; JSON or SSE chunks ending
``data: [DONE]`` (an optional usage chunk before it)."""

from __future__ import annotations

import time

from services.gateway import generation as g
from services.gateway.engines import EnginePool
from services.gateway.request_fields import refuse_unsupported
from services.gateway.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo
from services.gateway.responses import event_stream, respond, sse


def _prompt_ids(req: CompletionRequest, tokenizer) -> list[int]:
    """One prompt only (a string, a list of one string, token ids, or a list of one id list)."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], (str, list)):
        if len(p) != 1:
            raise g.RequestError("several prompts in one request are not supported; send one per request", "prompt")
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise g.RequestError("prompt is empty", "prompt")
        return tokenizer.encode(p)
    if not p:
        raise g.RequestError("prompt is empty", "prompt")
    bad = [t for t in p if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise g.RequestError(f"prompt token ids outside the vocabulary [0, {tokenizer.vocab_size}): {bad[:5]}",
                             "prompt")
    return list(p)


def prepare(pool: EnginePool, req: CompletionRequest) -> g.Generation:
    refuse_unsupported(req)  # first: a refused field is the answer, whatever else is wrong
    engine = pool.pick(req.model)
    ids = _prompt_ids(req, engine.tokenizer)
    explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    max_tokens = g.fit_max_tokens(engine, len(ids), req.max_tokens, explicit=explicit)
    sampling = g.sampling_from_request(req, engine, max_tokens)
    return g.Generation(engine, ids, sampling, g.stop_list(req.stop))


async def create_completion(pool: EnginePool, req: CompletionRequest, is_disconnected=None):
    gen = prepare(pool, req)

    def body(response_id: str) -> CompletionResponse:
        return CompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**gen.usage()),
                                  choices=[CompletionChoice(text=gen.text, finish_reason=gen.finish_reason)])

    return await respond(pool, gen, req, "cmpl",
                         lambda stream, response_id, usage: _stream(gen, stream, req.model, response_id, usage),
                         body, is_disconnected)


def _stream(gen: g.Generation, stream, model: str, response_id: str, include_usage: bool):
    created = int(time.time())

    def events_of(d: g.Delta):
        if d.text or d.finish_reason:
            choice = CompletionChoice(text=d.text, finish_reason=d.finish_reason)
            body = CompletionResponse(id=response_id, created=created, model=model, choices=[choice]).model_dump()
            if not include_usage:
                body.pop("usage")
            yield sse(body)

    def usage_chunk() -> dict:
        return CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                  usage=UsageInfo(**gen.usage())).model_dump()

    return event_stream(gen, stream, events_of, usage_chunk if include_usage else None)

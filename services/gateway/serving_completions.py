"""POST /v1/completions: a text prompt (or token ids) in, text out; JSON or SSE chunks ending
``data: [DONE]`` (an optional usage chunk before it)."""

from __future__ import annotations

import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway import generation as g
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo, new_id
from services.gateway.serving_chat import SSE_HEADERS, sse


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
    if req.suffix:
        raise g.RequestError("suffix is not supported", "suffix")
    if req.echo:
        raise g.RequestError("echo is not supported", "echo")
    engine = pool.pick(req.model)
    ids = _prompt_ids(req, engine.tokenizer)
    explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    max_tokens = g.fit_max_tokens(engine, len(ids), req.max_tokens, explicit=explicit)
    sampling = g.sampling_from_request(req, engine, max_tokens)
    return g.Generation(engine, ids, sampling, g.stop_list(req.stop))


async def create_completion(pool: EnginePool, req: CompletionRequest, is_disconnected=None):
    gen = prepare(pool, req)
    stream = await g.start(pool, gen)
    response_id = new_id("cmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(gen, stream, req.model, response_id, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    if not await g.complete(gen, stream, is_disconnected):
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    body = CompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**gen.usage()),
                              choices=[CompletionChoice(text=gen.text, finish_reason=gen.finish_reason)])
    return JSONResponse(body.model_dump())


async def _stream(gen: g.Generation, stream, model: str, response_id: str, include_usage: bool):
    created = int(time.time())

    def chunk(text: str, finish: str | None) -> str:
        body = CompletionResponse(id=response_id, created=created, model=model,
                                  choices=[CompletionChoice(text=text, finish_reason=finish)]).model_dump()
        if not include_usage:
            body.pop("usage")
        return sse(body)

    try:
        async for d in g.deltas(gen, stream):
            if d.text or d.finish_reason:
                yield chunk(d.text, d.finish_reason)
    except EngineError as exc:
        yield sse(exc.body)
        yield sse("[DONE]")
        return
    if include_usage:
        body = CompletionResponse(id=response_id, created=created, model=model, choices=[],
                                  usage=UsageInfo(**gen.usage())).model_dump()
        yield sse(body)
    yield sse("[DONE]")

"""POST /v1/chat/completions: template the messages with the engine's chat template, tokenize, generate,
answer as one JSON or as SSE chunks (first delta carries the role, one id for every chunk, the last
choice chunk carries finish_reason, an optional usage chunk, then ``data: [DONE]``)."""

from __future__ import annotations

import json
import time

from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.common.chat_template import ChatTemplateError, render_chat
from services.gateway import generation as g
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatChunkChoice, ChatResponseMessage, DeltaMessage, UsageInfo, new_id)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def _messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise g.RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        msg = m.model_dump(exclude_none=True)
        msg["content"] = m.text()
        out.append(msg)
    return out


def prepare(pool: EnginePool, req: ChatCompletionRequest) -> g.Generation:
    """Validate, template and tokenize; raises RequestError / EngineError (404 unknown model, 503)."""
    engine = pool.pick(req.model)
    kwargs = dict(req.chat_template_kwargs or {})
    try:
        prompt = render_chat(engine.info.get("tokenizer_config") or {}, _messages(req), add_generation_prompt=True,
                             tools=req.tools, **kwargs)
    except ChatTemplateError as exc:
        raise g.RequestError(str(exc), "messages") from exc
    ids = engine.tokenizer.encode(prompt)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = g.fit_max_tokens(engine, len(ids), asked, explicit=asked is not None)
    sampling = g.sampling_from_request(req, engine, max_tokens)
    return g.Generation(engine, ids, sampling, g.stop_list(req.stop))


async def create_chat_completion(pool: EnginePool, req: ChatCompletionRequest, is_disconnected=None):
    gen = prepare(pool, req)
    stream = await g.start(pool, gen)
    response_id = new_id("chatcmpl")
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(gen, stream, req.model, response_id, include_usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    if not await g.complete(gen, stream, is_disconnected):
        return Response(status_code=499)  # client closed the request (nginx's code); nobody reads it
    body = ChatCompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**gen.usage()),
                                  choices=[ChatChoice(message=ChatResponseMessage(content=gen.text),
                                                      finish_reason=gen.finish_reason)])
    return JSONResponse(body.model_dump())


async def _stream(gen: g.Generation, stream, model: str, response_id: str, include_usage: bool):
    created = int(time.time())

    def chunk(delta: DeltaMessage, finish: str | None = None, choices: bool = True) -> str:
        c = ChatCompletionChunk(id=response_id, created=created, model=model,
                                choices=[ChatChunkChoice(delta=delta, finish_reason=finish)] if choices else [])
        body = c.model_dump(exclude={"usage"})
        body["choices"] = [{**ch, "delta": {k: v for k, v in ch["delta"].items() if v is not None}}
                           for ch in body["choices"]]
        if include_usage:
            body["usage"] = None
        return sse(body)

    yield chunk(DeltaMessage(role="assistant", content=""))
    try:
        async for d in g.deltas(gen, stream):
            if d.text:
                yield chunk(DeltaMessage(content=d.text))
            if d.finish_reason:
                yield chunk(DeltaMessage(), d.finish_reason)
    except EngineError as exc:
        yield sse(exc.body)
        yield sse("[DONE]")
        return
    if include_usage:
        body = ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                   usage=UsageInfo(**gen.usage())).model_dump()
        yield sse(body)
    yield sse("[DONE]")

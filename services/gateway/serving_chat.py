"""POST /v1/chat/completions: template the messages with the engine's chat template, tokenize, generate,
answer as one JSON or as SSE chunks (first delta carries the role, one id for every chunk, the last
choice chunk carries finish_reason, an optional usage chunk, then ``data: [DONE]``); n choices and
logprobs as OpenAI gives them (responses.py, logprobs.py)."""

from __future__ import annotations

import time

from services.common.chat_template import ChatTemplateError, render_chat
from services.gateway import generation as g
from services.gateway.engines import EnginePool
from services.gateway.request_fields import refuse_unsupported
from services.gateway.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatChunkChoice, ChatResponseMessage, DeltaMessage, UsageInfo)
from services.gateway.logprobs import chat_logprobs
from services.gateway.responses import event_stream, respond, sse, usage


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
    refuse_unsupported(req)  # first: a refused field is the answer, whatever else is wrong
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
    gens = prepare(pool, req).choices(req.n or 1)
    tokenizer = gens[0].engine.tokenizer

    def logprobs(gen: g.Generation, entries: list[dict] | None) -> dict | None:
        return chat_logprobs(entries or [], tokenizer) if gen.sampling.get("logprobs") is not None else None

    def body(response_id: str) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**usage(gens)),
                                      choices=[ChatChoice(index=x.index, message=ChatResponseMessage(content=x.text),
                                                          logprobs=logprobs(x, x.logprobs),
                                                          finish_reason=x.finish_reason) for x in gens])

    return await respond(pool, gens, req, "chatcmpl",
                         lambda streams, response_id, include_usage: _stream(
                             gens, streams, req.model, response_id, include_usage, logprobs),
                         body, is_disconnected)


def _stream(gens: list[g.Generation], streams, model: str, response_id: str, include_usage: bool, logprobs):
    created = int(time.time())

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None, lp: dict | None = None) -> str:
        c = ChatCompletionChunk(id=response_id, created=created, model=model,
                                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)])
        body = c.model_dump(exclude={"usage"})
        body["choices"] = [{**ch, "delta": {k: v for k, v in ch["delta"].items() if v is not None}}
                           for ch in body["choices"]]
        if include_usage:
            body["usage"] = None
        return sse(body)

    def events_of(gen: g.Generation, d: g.Delta):
        if d.text or d.logprobs:
            yield chunk(gen.index, DeltaMessage(content=d.text), lp=logprobs(gen, d.logprobs))
        if d.finish_reason:
            yield chunk(gen.index, DeltaMessage(), d.finish_reason)

    def usage_chunk() -> dict:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                   usage=UsageInfo(**usage(gens))).model_dump()

    return event_stream(gens, streams, events_of, usage_chunk if include_usage else None,
                        opening=[chunk(x.index, DeltaMessage(role="assistant", content="")) for x in gens])

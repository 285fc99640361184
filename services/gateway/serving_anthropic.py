"""POST /v1/messages: Anthropic's Messages API over the same engines (the `anthropic` SDK, agent tools).

The request becomes a chat completion (``system`` first as a system message, text content blocks
joined) and runs through serving_chat's preparation (chat template, tokenizer, limits); the answer is
Anthropic's message, or its stream of named events: ``message_start``, ``content_block_start``,
``ping``, ``content_block_delta`` (text_delta)..., ``content_block_stop``, ``message_delta`` (stop
reason and output tokens), ``message_stop``; an engine failure mid-stream is an ``error`` event.

The same rule as the OpenAI endpoints: every field is honoured or refused with a 400 naming it
(request_fields.ANTHROPIC_FIELDS), unknown fields too. API keys are checked as on /v1 (``x-api-key``,
which Anthropic clients send, or ``Authorization: Bearer``). Errors have Anthropic's shape
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway import generation as g
from services.gateway.auth import AuthError
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import ChatCompletionRequest, new_id
from services.gateway.request_fields import ANTHROPIC_FIELDS, refuse_fields
from services.gateway.responses import SSE_HEADERS
from services.gateway.serving_chat import prepare

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class TextBlock(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: hints with no effect on the text
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[TextBlock]


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it
    model: str
    messages: list[Message] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    cache_control: Any = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: Any = None
    metadata: dict[str, Any] | None = None
    output_config: Any = None
    service_tier: str | None = None
    speed: Any = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    system: str | list[TextBlock] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    thinking: dict[str, Any] | None = None
    tool_choice: Any = None
    tools: list[dict[str, Any]] | None = None
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user_profile_id: Any = None
    workspace_id: Any = None


def _text(content: str | list[TextBlock], where: str) -> str:
    if isinstance(content, str):
        return content
    for i, block in enumerate(content):
        if block.type != "text":
            raise g.RequestError(f"{where}[{i}]: content blocks of type {block.type!r} are not supported "
                                 "(text only)", where)
    return "".join(b.text or "" for b in content)


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the engine for the same thing."""
    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    messages += [{"role": m.role, "content": _text(m.content, f"messages[{i}].content")}
                 for i, m in enumerate(req.messages)]
    fields = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
              "temperature": req.temperature, "top_p": req.top_p,
              "top_k": req.top_k if req.top_k else None}  # Anthropic's top_k 0 is "off", as Tandem's
    return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                    "message": message}}, status)


def _stop_reason(gen: g.Generation) -> tuple[str, str | None]:
    if gen.finish_reason == "length":
        return "max_tokens", None
    if gen.stop_string is not None:
        return "stop_sequence", gen.stop_string
    return "end_turn", None


def _usage(gen: g.Generation) -> dict:
    return {"input_tokens": gen.prompt_tokens - gen.cached_tokens, "output_tokens": gen.completion_tokens,
            "cache_read_input_tokens": gen.cached_tokens, "cache_creation_input_tokens": 0}


def _message(msg_id: str, model: str, gen: g.Generation, content: list[dict], stop: tuple) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop[0], "stop_sequence": stop[1], "usage": _usage(gen)}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def _events(gen: g.Generation, stream, msg_id: str, model: str):
    start = _message(msg_id, model, gen, [], (None, None))
    yield _event("message_start", {"type": "message_start", "message": start})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {"type": "ping"})
    try:
        async for d in g.deltas(gen, stream):
            if d.text:
                yield _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                                     "delta": {"type": "text_delta", "text": d.text}})
    except EngineError as exc:
        yield _event("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}})
        return
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    reason, sequence = _stop_reason(gen)
    yield _event("message_delta", {"type": "message_delta",
                                   "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                   "usage": {"output_tokens": gen.completion_tokens}})
    yield _event("message_stop", {"type": "message_stop"})


async def create_message(pool: EnginePool, request: Request, check_key) -> Response:
    """The whole route: key, body, fields, generation; every error in Anthropic's shape."""
    try:
        await check_key(request)
        try:
            req = MessagesRequest.model_validate(json.loads(await request.body()))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"request body is not valid JSON: {exc}")
        except ValidationError as exc:
            return error(400, _validation_message(exc))
        request.state.model_name = req.model
        refuse_fields(req, ANTHROPIC_FIELDS)
        gen = prepare(pool, to_chat(req))
        stream = await g.start(pool, gen)
    except (AuthError, g.RequestError, EngineError) as exc:
        return error(exc.status, exc.body["error"]["message"])
    msg_id = new_id("msg").replace("msg-", "msg_")
    if req.stream:
        return StreamingResponse(_events(gen, stream, msg_id, req.model), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        if not await g.complete(gen, stream, request.is_disconnected):
            return Response(status_code=499)  # the client left; nobody reads an answer
    except EngineError as exc:
        return error(exc.status, exc.body["error"]["message"])
    content = [{"type": "text", "text": gen.text}]
    return JSONResponse(_message(msg_id, req.model, gen, content, _stop_reason(gen)))


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "body"
        msg = "unknown field; Tandem does not support it" if e.get("type") == "extra_forbidden" else e.get("msg")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)

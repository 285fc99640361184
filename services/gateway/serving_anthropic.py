"""POST /v1/messages: Anthropic's Messages API over the same engines (the `anthropic` SDK, agent tools).

The request becomes a chat completion (``system`` first as a system message, text content blocks
joined) and runs through serving_chat's preparation (chat template, tokenizer, limits); the answer is
Anthropic's message, or its stream of named events: ``message_start``, ``ping``, then per content
block ``content_block_start``, ``content_block_delta`` (text_delta, or input_json_delta for a
tool_use block)..., ``content_block_stop``, then ``message_delta`` (stop reason and output tokens) and
``message_stop``; an engine failure mid-stream is an ``error`` event.

Tools go through the chat path's tool calling (chat_tools.py): ``tools`` (input_schema) become function
tools, ``tool_choice`` auto / any / tool / none become auto / required / a named function / none
(``disable_parallel_tool_use``: parallel_tool_calls false), tool_use blocks of assistant turns become
their tool_calls and tool_result blocks become tool messages; calls come back as tool_use blocks with
stop_reason "tool_use".

The same rule as the OpenAI endpoints: every field is honoured or refused with a 400 naming it
(request_fields.ANTHROPIC_FIELDS), unknown fields too. API keys are checked as on /v1 (``x-api-key``,
which Anthropic clients send, or ``Authorization: Bearer``). Errors have Anthropic's shape
{"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway import generation as g
from services.gateway.auth import AuthError
from services.gateway.chat_tools import ToolPlan, answer_message, tool_call_out, tool_finish
from services.gateway.engines import EngineError, EnginePool
from services.gateway.protocol import ChatCompletionRequest, new_id
from services.gateway.request_fields import ANTHROPIC_FIELDS, refuse_fields
from services.gateway.responses import SSE_HEADERS
from services.gateway.serving_chat import prepare_with_tools
from services.gateway.tool_parsers import ToolCallStream

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class Block(BaseModel):
    """A content block: text, tool_use (assistant) or tool_result (user); other fields (cache_control,
    citations) are hints with no effect on the text."""
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list["Block"] | None = None  # tool_result
    is_error: bool | None = None  # tool_result


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["user", "assistant"]
    content: str | list[Block]


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
    system: str | list[Block] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    thinking: dict[str, Any] | None = None
    tool_choice: Any = None
    tools: list[dict[str, Any]] | None = None
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user_profile_id: Any = None
    workspace_id: Any = None


def _text(content: str | list[Block] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    for i, block in enumerate(content):
        if block.type != "text":
            raise g.RequestError(f"{where}[{i}]: content blocks of type {block.type!r} are not supported here "
                                 "(text, and tool_use / tool_result in messages)", where)
    return "".join(b.text or "" for b in content)


def _chat_messages(m: Message, i: int) -> list[dict]:
    """One Anthropic turn as chat messages: an assistant's tool_use blocks become its tool_calls, a user's
    tool_result blocks become tool messages (before the turn's own text)."""
    where = f"messages[{i}].content"
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    kinds = {"assistant": ("text", "tool_use"), "user": ("text", "tool_result")}[m.role]
    for j, b in enumerate(m.content):
        if b.type not in kinds:
            raise g.RequestError(f"{where}[{j}]: content blocks of type {b.type!r} are not supported in a "
                                 f"{m.role} turn ({', '.join(kinds)})", where)
    text = "".join(b.text or "" for b in m.content if b.type == "text")
    if m.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input or {})}}
                 for b in m.content if b.type == "tool_use"]
        return [{"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}]
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _text(b.content, where)}
           for b in m.content if b.type == "tool_result"]
    return out + ([{"role": "user", "content": text}] if text or not out else [])


def _tools(req: MessagesRequest) -> dict:
    """tools / tool_choice as the chat request's fields (Anthropic's client tools; server tools: 400)."""
    if not req.tools:
        return {"tool_choice": "none"} if (req.tool_choice or {}).get("type") == "none" else {}
    tools = []
    for i, t in enumerate(req.tools):
        if t.get("type") not in (None, "custom") or "input_schema" not in t:
            raise g.RequestError(f"tools[{i}]: only client tools (name, description, input_schema) are supported",
                                 "tools")
        fn = {"name": t.get("name"), "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    choice = req.tool_choice or {"type": "auto"}
    kind = choice.get("type")
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        mapped = {"type": "function", "function": {"name": choice.get("name")}}
    if mapped is None:
        raise g.RequestError(f"tool_choice type {kind!r} is not one of auto, any, tool, none", "tool_choice")
    out = {"tools": tools, "tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def to_chat(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that asks the engine for the same thing."""
    messages = [{"role": "system", "content": _text(req.system, "system")}] if req.system else []
    for i, m in enumerate(req.messages):
        messages += _chat_messages(m, i)
    fields = {"model": req.model, "messages": messages, "max_tokens": req.max_tokens, "stop": req.stop_sequences,
              "temperature": req.temperature, "top_p": req.top_p,
              "top_k": req.top_k if req.top_k else None,  # Anthropic's top_k 0 is "off", as Tandem's
              **_tools(req)}
    return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def _content(plan: ToolPlan, gen: g.Generation) -> tuple[list[dict], str | None]:
    """The answer's content blocks (text, then tool_use) and the chat finish_reason."""
    message, finish = answer_message(plan, gen.text, gen.finish_reason, gen.calls)
    blocks = [{"type": "text", "text": message.content}] if message.content or not message.tool_calls else []
    blocks += [_tool_use(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return blocks, finish


def _tool_use(call_id: str, name: str, arguments: str) -> dict:
    return {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)}


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"),
                                                    "message": message}}, status)


def _stop_reason(gen: g.Generation, finish: str | None) -> tuple[str, str | None]:
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
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


class _Blocks:
    """Anthropic's content-block events of a stream: a text block opened at the first text, closed
    before a tool_use block (each complete call: start, one input_json_delta, stop)."""

    def __init__(self):
        self.index = -1
        self.text_open = False

    def text(self, text: str):
        if not self.text_open:
            self.index += 1
            self.text_open = True
            yield _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": {"type": "text", "text": ""}})
        yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "text_delta", "text": text}})

    def close_text(self):
        if self.text_open:
            self.text_open = False
            yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def tool_use(self, call_id: str, name: str, arguments: str):
        yield from self.close_text()
        self.index += 1
        yield _event("content_block_start", {"type": "content_block_start", "index": self.index,
                                             "content_block": {"type": "tool_use", "id": call_id, "name": name,
                                                               "input": {}}})
        yield _event("content_block_delta", {"type": "content_block_delta", "index": self.index,
                                             "delta": {"type": "input_json_delta", "partial_json": arguments}})
        yield _event("content_block_stop", {"type": "content_block_stop", "index": self.index})


async def _events(gen: g.Generation, plan: ToolPlan, stream, msg_id: str, model: str):
    yield _event("message_start", {"type": "message_start", "message": _message(msg_id, model, gen, [], (None, None))})
    yield _event("ping", {"type": "ping"})
    blocks, calls = _Blocks(), ToolCallStream(plan.parser, plan.parallel) if plan.parser else None
    finish = None
    try:
        async for d in g.deltas(gen, stream):
            text, done = calls.feed(d.text, d.finish_reason is not None, d.calls) if calls else (d.text, [])
            if text:
                for event in blocks.text(text):
                    yield event
            for call in done:
                out = tool_call_out(plan.parser, call)
                for event in blocks.tool_use(out.id, out.function.name, out.function.arguments):
                    yield event
            finish = d.finish_reason
    except EngineError as exc:
        yield _event("error", {"type": "error", "error": {"type": "api_error", "message": str(exc)}})
        return
    if blocks.index < 0:  # nothing at all was generated: one empty text block, as Anthropic sends
        for event in blocks.text(""):
            yield event
    for event in blocks.close_text():
        yield event
    reason, sequence = _stop_reason(gen, tool_finish(finish) if calls and calls.sent else finish)
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
            chat = to_chat(req)  # the chat request's checks too (a lone surrogate in any string: 400)
        except ValidationError as exc:
            return error(400, _validation_message(exc))
        except (ValueError, RecursionError) as exc:  # not JSON or UTF-8, a 4300+-digit number, nested too deep
            return error(400, f"request body is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}")
        if req.model in pool.models():  # a metric label only from the bounded set of served models
            request.state.model_name = req.model
        refuse_fields(req, ANTHROPIC_FIELDS)
        # off the event loop: templating and tokenizing a long prompt take seconds of CPU
        gen, plan = await asyncio.to_thread(prepare_with_tools, pool, chat)
        stream = await g.start(pool, gen)
    except (AuthError, g.RequestError, EngineError) as exc:
        return error(exc.status, exc.body["error"]["message"])
    msg_id = new_id("msg").replace("msg-", "msg_")
    if req.stream:
        return StreamingResponse(_events(gen, plan, stream, msg_id, req.model), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        if not await g.complete(gen, stream, request.is_disconnected):
            return Response(status_code=499)  # the client left; nobody reads an answer
    except EngineError as exc:
        return error(exc.status, exc.body["error"]["message"])
    content, finish = _content(plan, gen)
    return JSONResponse(_message(msg_id, req.model, gen, content, _stop_reason(gen, finish)))


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "body"
        msg = "unknown field; Tandem does not support it" if e.get("type") == "extra_forbidden" else e.get("msg")
        parts.append(f"{where}: {msg}")
    return "; ".join(parts)

"""POST /v1/chat/completions: template the messages with the engine's chat template, tokenize, generate,
answer as one JSON or as SSE chunks (first delta carries the role, one id for every chunk, the last
choice chunk carries finish_reason, an optional usage chunk, then ``data: [DONE]``); n choices and
logprobs as OpenAI gives them (responses.py, logprobs.py).

Tool calls (chat_tools.py, tool_parsers.py) and response_format (structured_output.py) are planned in
``prepare``: a forced call or a JSON format becomes the engine's grammar."""

from __future__ import annotations

import asyncio
import inspect
import time

from services.common.chat_template import ChatTemplateError, render_chat, select_template, template_variables
from services.gateway import generation as g
from services.gateway.chat_tools import (ToolPlan, answer_message, call_deltas, plan_tools, template_message,
                                         tool_finish)
from services.gateway.engines import EnginePool
from services.gateway.logprobs import chat_logprobs
from services.gateway.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                       ChatChunkChoice, DeltaMessage, UsageInfo)
from services.gateway.request_fields import refuse_unsupported
from services.gateway.responses import event_stream, respond, sse, usage
from services.gateway.structured_output import grammar_for_response_format
from services.gateway.tool_parsers import ToolCallStream


def _messages(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
            raise g.RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        msg = m.model_dump(exclude_none=True)
        msg["content"] = m.text()
        out.append(template_message(msg))
    return out


# render_chat's own arguments: chat_template_kwargs may not set them (a TypeError deep in the render)
_TEMPLATE_ARGUMENTS = {name for name, p in inspect.signature(render_chat).parameters.items()
                       if p.kind is not inspect.Parameter.VAR_KEYWORD}


def template_kwargs(given: dict | None, open_to: frozenset[str] = frozenset()) -> dict:
    """A request's chat_template_kwargs, refused (400) when they name one of render_chat's own arguments
    that the caller sets itself (all but ``open_to``: /tokenize takes tools and documents this way)."""
    kwargs = dict(given or {})
    reserved = sorted((_TEMPLATE_ARGUMENTS - open_to) & set(kwargs))
    if reserved:
        raise g.RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: the gateway sets "
                             f"{'them' if len(reserved) > 1 else 'it'} from the request", "chat_template_kwargs")
    return kwargs


REASONING_EFFORTS = ("low", "medium", "high")


def with_reasoning_effort(effort, tokenizer_config: dict, tools: list[dict] | None, kwargs: dict) -> dict:
    """``kwargs`` plus the template's ``reasoning_effort`` variable (gpt-oss: the system message's
    "Reasoning:" line); a 400 when the model's template has no such variable (the field would change
    nothing), when the value is not one of low / medium / high, or when chat_template_kwargs says otherwise."""
    if effort not in REASONING_EFFORTS:
        raise g.RequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                             "reasoning_effort")
    try:
        variables = template_variables(select_template(tokenizer_config, tools))
    except ChatTemplateError as exc:
        raise g.RequestError(str(exc), "messages") from exc
    if "reasoning_effort" not in variables:
        raise g.RequestError("reasoning_effort is not supported by this model: its chat template has no "
                             "reasoning_effort variable (gpt-oss's has); models that can think may take "
                             "chat_template_kwargs such as {\"enable_thinking\": false}", "reasoning_effort")
    if kwargs.get("reasoning_effort", effort) != effort:
        raise g.RequestError(f"reasoning_effort {effort!r} and chat_template_kwargs.reasoning_effort "
                             f"{kwargs['reasoning_effort']!r} disagree: send one", "reasoning_effort")
    return {**kwargs, "reasoning_effort": effort}


def prepare(pool: EnginePool, req: ChatCompletionRequest) -> g.Generation:
    """``prepare_with_tools`` for callers that answer with text only (a request whose output would be
    parsed into tool calls is refused rather than answered with the calls' raw text)."""
    gen, plan = prepare_with_tools(pool, req)
    if plan.parser is not None:
        raise g.RequestError("tools are not served on this endpoint", "tools")
    return gen


def prepare_with_tools(pool: EnginePool, req: ChatCompletionRequest) -> tuple[g.Generation, ToolPlan]:
    """Validate, plan tools, template and tokenize (CPU-bound: run it in a worker thread); raises
    RequestError / EngineError (404 unknown model, 503)."""
    refuse_unsupported(req)  # first: a refused field is the answer, whatever else is wrong
    engine = pool.pick(req.model)
    kwargs = template_kwargs(req.chat_template_kwargs)
    tokenizer_config = engine.info.get("tokenizer_config") or {}
    plan = plan_tools(req, tokenizer_config, engine.tokenizer)
    if req.reasoning_effort is not None:
        kwargs = with_reasoning_effort(req.reasoning_effort, tokenizer_config, plan.tools, kwargs)
    try:
        prompt = render_chat(tokenizer_config, _messages(req), add_generation_prompt=True, tools=plan.tools,
                             **kwargs)
    except ChatTemplateError as exc:
        raise g.RequestError(str(exc), "messages") from exc
    g.refuse_overlong_prompt(engine, prompt, "messages")
    ids = engine.tokenizer.encode(prompt)
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = g.fit_max_tokens(engine, len(ids), asked, explicit=asked is not None)
    sampling = g.sampling_from_request(req, engine, max_tokens)
    grammar = plan.grammar or grammar_for_response_format(req.response_format, engine.tokenizer)
    if grammar is not None:
        sampling["grammar"] = grammar
    make_call = plan.parser.call_from_body if plan.parser is not None and plan.parser.structured else None
    return g.Generation(engine, ids, sampling, g.stop_list(req.stop), skip_special_tokens=not plan.keep_special_tokens,
                        make_call=make_call), plan


async def create_chat_completion(pool: EnginePool, req: ChatCompletionRequest, is_disconnected=None):
    # off the event loop: templating and tokenizing a long prompt take seconds of CPU
    gen, plan = await asyncio.to_thread(prepare_with_tools, pool, req)
    gens = gen.choices(req.n or 1)
    tokenizer = gens[0].engine.tokenizer

    def logprobs(gen: g.Generation, entries: list[dict] | None) -> dict | None:
        return chat_logprobs(entries or [], tokenizer) if gen.sampling.get("logprobs") is not None else None

    def choice(x: g.Generation) -> ChatChoice:
        message, finish = answer_message(plan, x.text, x.finish_reason, x.calls)
        if x.reasoning:
            message.reasoning_content = x.reasoning
        return ChatChoice(index=x.index, message=message, logprobs=logprobs(x, x.logprobs), finish_reason=finish)

    def body(response_id: str) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=response_id, model=req.model, usage=UsageInfo(**usage(gens)),
                                      choices=[choice(x) for x in gens])

    return await respond(pool, gens, req, "chatcmpl",
                         lambda streams, response_id, include_usage: _stream(
                             gens, plan, streams, req.model, response_id, include_usage, logprobs),
                         body, is_disconnected)


def _stream(gens: list[g.Generation], plan: ToolPlan, streams, model: str, response_id: str, include_usage: bool,
            logprobs):
    created = int(time.time())
    calls = {x.index: ToolCallStream(plan.parser, plan.parallel) for x in gens} if plan.parser else {}

    def chunk(index: int, delta: DeltaMessage, finish: str | None = None, lp: dict | None = None) -> str:
        c = ChatCompletionChunk(id=response_id, created=created, model=model,
                                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=lp, finish_reason=finish)])
        body = c.model_dump(exclude={"usage"})
        body["choices"] = [{**ch, "delta": delta.model_dump(exclude_none=True)} for ch in body["choices"]]
        if include_usage:
            body["usage"] = None
        return sse(body)

    def events_of(gen: g.Generation, d: g.Delta):
        if d.reasoning:  # harmony: the analysis channel, before the answer text of the same delta
            yield chunk(gen.index, DeltaMessage(reasoning_content=d.reasoning))
        tools = calls.get(gen.index)
        if tools is None:
            if d.text or d.logprobs:
                yield chunk(gen.index, DeltaMessage(content=d.text), lp=logprobs(gen, d.logprobs))
            if d.finish_reason:
                yield chunk(gen.index, DeltaMessage(), d.finish_reason)
            return
        content, done = tools.feed(d.text, d.finish_reason is not None, d.calls)
        if content or d.logprobs:
            yield chunk(gen.index, DeltaMessage(content=content), lp=logprobs(gen, d.logprobs))
        for i, call in enumerate(done):
            for delta in call_deltas(plan.parser, call, tools.sent - len(done) + i):
                yield chunk(gen.index, delta)
        if d.finish_reason:
            yield chunk(gen.index, DeltaMessage(), tool_finish(d.finish_reason) if tools.sent else d.finish_reason)

    def usage_chunk() -> dict:
        return ChatCompletionChunk(id=response_id, created=created, model=model, choices=[],
                                   usage=UsageInfo(**usage(gens))).model_dump()

    return event_stream(gens, streams, events_of, usage_chunk if include_usage else None,
                        opening=[chunk(x.index, DeltaMessage(role="assistant", content="")) for x in gens])

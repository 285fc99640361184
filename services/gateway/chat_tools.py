"""Tool calling for /v1/chat/completions: what ``tools``, ``tool_choice`` and ``parallel_tool_calls`` ask
of one request (``plan_tools``), and the answer's message built from the generated text.

    tool_choice   the tools are          the output is                          generation
    none          rendered in the prompt  content only (never parsed)            free
    auto          rendered                parsed: content and/or tool_calls      free
    required      rendered                one or more calls (one: parallel off)  forced by a grammar
    {function}    rendered                exactly one call of that function      forced by a grammar

The syntax is the model family's (services/gateway/tool_parsers.py, chosen by the chat template); a
template that writes no syntax Tandem knows is refused with a 400 unless tool_choice is "none".
Harmony (gpt-oss) calls are found on the token ids (reasoning.py) and come with the generation
(``Generation.calls``); its forced call lets the model reason first (analysis) and constrains the call
message only, and since ``<|call|>`` ends the turn a harmony answer holds one call.
Assistant messages' ``tool_calls`` come back with their ``arguments`` as objects, the way chat templates
(transformers') expect them, and ``tool`` messages pass through to the template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.common.chat_template import ChatTemplateError, select_template
from services.gateway.generation import RequestError
from services.gateway.protocol import (ChatCompletionRequest, ChatResponseMessage, DeltaFunctionCall, DeltaMessage,
                                       DeltaToolCall, FunctionCall, NamedToolChoice, ToolCallOut)
from services.gateway.tool_parsers import PARSERS, ToolCall, ToolParser, parser_for


@dataclass
class ToolPlan:
    tools: list[dict] | None = None  # for the chat template (None: no tools)
    parser: ToolParser | None = None  # parses the output (None: content only)
    parallel: bool = True
    grammar: dict | None = None  # the engine's grammar of a forced call
    keep_special_tokens: bool = False  # the family's marker is a special token: decode it into the text


def plan_tools(req: ChatCompletionRequest, tokenizer_config: dict, tokenizer) -> ToolPlan:
    """Validate the request's tool fields (RequestError names the field) and plan the generation."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):  # nothing to call: only "none" and "auto" make sense
            raise RequestError("tool_choice needs tools: none were given", "tool_choice")
        return ToolPlan()
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise RequestError(f"tools: function names must be unique, got {names}", "tools")
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(tools, None, parallel)
    try:
        template = select_template(tokenizer_config, tools)
    except ChatTemplateError as exc:
        raise RequestError(str(exc), "messages") from exc
    parser = parser_for(template)
    if parser is None:
        raise RequestError(f"tools: this model's chat template writes no tool-call syntax Tandem can parse "
                           f"(known: {', '.join(PARSERS)}); send tool_choice \"none\" to only show the tools",
                           "tools")
    # a special marker token (Mistral's [TOOL_CALLS]) is decoded into the text, or no call could be found;
    # the answer's other special tokens then show too (a model rarely writes any before its EOS)
    keep = parser.special_marker(tokenizer) is not None
    if choice in (None, "auto"):
        return ToolPlan(tools, parser, parallel, keep_special_tokens=keep)
    if isinstance(choice, NamedToolChoice):
        forced = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not forced:
            raise RequestError(f"tool_choice names function {choice.function.name!r}, which is not among "
                               f"the tools ({', '.join(names)})", "tool_choice")
        parallel = False  # a named function: exactly one call of it
    else:
        forced = tools
    if req.response_format is not None and req.response_format.type != "text":
        raise RequestError("a forced tool call (tool_choice required or a function) cannot be combined with "
                           "response_format", "response_format")
    try:
        grammar = parser.forced_grammar(forced, parallel, tokenizer)
    except ValueError as exc:  # a harmony template over a tokenizer without the harmony markers
        raise RequestError(f"tool_choice: {exc}", "tool_choice") from exc
    return ToolPlan(tools, parser, parallel, {"lark": grammar}, keep)


def template_message(message: dict) -> dict:
    """An OpenAI message as chat templates want it: tool_calls' arguments as objects, not JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    out = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except ValueError:
                pass  # not JSON: the template prints the text as it is
        out.append({**call, "function": fn})
    return {**message, "tool_calls": out}


def answer_message(plan: ToolPlan, text: str, finish_reason: str | None,
                   parsed: list[ToolCall] = ()) -> tuple[ChatResponseMessage, str | None]:
    """The response's message and finish_reason for a finished generation's text (``parsed``: the calls
    found on the token ids, for a structured family: harmony)."""
    if plan.parser is None:
        return ChatResponseMessage(content=text), finish_reason
    content, calls = (text or None, list(parsed)) if plan.parser.structured else plan.parser.parse(text)
    if not calls:
        return ChatResponseMessage(content=text), finish_reason
    calls = calls if plan.parallel else calls[:1]
    message = ChatResponseMessage(content=content, tool_calls=[tool_call_out(plan.parser, c) for c in calls])
    return message, tool_finish(finish_reason)


def tool_call_out(parser: ToolParser, call: ToolCall) -> ToolCallOut:
    call.id = call.id or parser.new_id()
    return ToolCallOut(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments))


def tool_finish(finish_reason: str | None) -> str | None:
    """OpenAI's finish_reason once calls were made: "tool_calls", unless max_tokens cut the output."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


def call_deltas(parser: ToolParser, call: ToolCall, index: int) -> list[DeltaMessage]:
    """One complete call as OpenAI streams it: index, id, type and name with empty arguments, then the
    arguments (clients concatenate the arguments of each index)."""
    out = tool_call_out(parser, call)
    head = DeltaToolCall(index=index, id=out.id, type="function", function=DeltaFunctionCall(name=call.name,
                                                                                             arguments=""))
    args = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=call.arguments))
    return [DeltaMessage(tool_calls=[head]), DeltaMessage(tool_calls=[args])]

"""Tool calls in a model family's own syntax: parsed out of the generated text into OpenAI ``tool_calls``,
and, for a forced call (``tool_choice`` "required" or a named function), a grammar that makes the
engine generate exactly that syntax (an llguidance Lark grammar embedding each tool's JSON schema:
services/engine/runtime/grammar.py).

A registry, one parser per family, chosen by the marker its chat template writes:

    hermes   (Qwen2.5, Qwen3, the demo model)   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                                                 one block per call, separated by newlines
    mistral  (Mixtral, Mistral)                  [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    harmony  (gpt-oss)                           <|channel|>commentary to=functions.NAME <|constrain|>json
                                                 <|message|>{...}<|call|>, one message per call, found in the
                                                 token stream, not in the text (services/gateway/reasoning.py);
                                                 ``<|call|>`` ends generation

Streaming (``ToolCallStream``): text before the family's start marker streams as content (a tail that
could still become the marker is held back); from the marker on, each call is sent once it is complete,
as OpenAI sends them: a delta with its index, id, type and name, then one with its arguments.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from services.gateway.reasoning import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = ""


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of ``tool`` (an OpenAI tools entry): {"name": const, "arguments": its
    parameters}, compact (no free whitespace, so a model cannot spend max_tokens on blanks)."""
    return {"type": "object", "properties": {"name": {"const": tool["function"]["name"]},
                                             "arguments": call_args_schema(tool)},
            "required": ["name", "arguments"], "additionalProperties": False}


def _any_call(tools: list[dict]) -> dict:
    schemas = [call_schema(t) for t in tools]
    return _compact(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})


def _lark_literal(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid Lark string literal (escapes included)


def _call_from_json(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """One family's tool-call syntax. ``start`` opens the calls; text before it is content."""

    family = ""
    start = ""
    structured = False  # True: the calls come parsed from the token stream (harmony), not from the text

    def detect(self, chat_template: str) -> bool:
        return self.start in chat_template

    def new_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        """The complete calls in ``text`` (what follows ``start``, the marker included); at the end
        (``final``) None when the text is not a well-formed call sequence."""
        raise NotImplementedError

    def forced_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """A Lark grammar whose every sentence is one call (or, ``parallel``, one or more) of ``tools``."""
        raise NotImplementedError

    def special_marker(self, tokenizer) -> int | None:
        """The id of ``start`` when it is a special token of ``tokenizer`` (decoding must then keep special
        tokens, or the marker vanishes from the text), else None."""
        tid = tokenizer.token_to_id(self.start)
        return tid if tid is not None and tokenizer.decode([tid], skip_special_tokens=True) == "" else None

    def marker(self, tokenizer) -> str:
        """``start`` in a Lark grammar: a special token by its id (it cannot be spelled as text), else text."""
        tid = self.special_marker(tokenizer)
        return f"<[{tid}]>" if tid is not None else _lark_literal(self.start)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished generation; malformed calls leave the whole text as content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        calls = self.calls(text[at:], final=True)
        if not calls:
            return text, []
        return text[:at].strip() or None, calls


class HermesToolParser(ToolParser):
    family = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        out = []
        for body in self._block.findall(text):
            try:
                call = _call_from_json(json.loads(body))
            except ValueError:
                call = None
            if call is None:  # a closed block that is no call: the text is not a call sequence
                return None if final else out
            out.append(call)
        # at the end, text after the last complete call (a block cut by max_tokens, say) is dropped
        return None if final and not out else out

    def forced_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        call = f'{_lark_literal(self.start + chr(10))} %json {json.dumps(_any_call(tools))} ' \
               f'{_lark_literal(chr(10) + self.end)}'
        return f'start: call{" (" + _lark_literal(chr(10)) + " call)*" if parallel else ""}\ncall: {call}\n'


class MistralToolParser(ToolParser):
    family = "mistral"
    start = "[TOOL_CALLS]"
    _ids = string.ascii_letters + string.digits

    def new_id(self) -> str:  # Mistral's templates require 9 alphanumeric characters
        return "".join(secrets.choice(self._ids) for _ in range(9))

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        body = text[len(self.start):].strip()
        try:
            data, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return None if final else []
        data = data if isinstance(data, list) else [data]
        out = [_call_from_json(item) for item in data]
        if None in out or not out or (final and body[end:].strip()):
            return None if final else []
        return out

    def forced_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        items = _any_call(tools)
        array = {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1}),
                 "x-guidance": {"whitespace_flexible": False}}
        return f'start: {self.marker(tokenizer)} " " %json {json.dumps(array)}\n'


class HarmonyToolParser(ToolParser):
    """gpt-oss: a call is a message addressed ``to=functions.NAME`` whose body is the arguments object.
    The channel markers are special tokens the text never shows, so the gateway's HarmonySplitter finds
    the calls on the token ids (``call_from_body`` turns each body into a ToolCall) and the text is only
    the answer. The template writes ``<|call|>`` after an earlier call; nothing else writes it."""

    family = "harmony"
    start = "<|call|>"
    structured = True

    def calls(self, text: str, final: bool) -> list[ToolCall] | None:
        return [] if not final else None  # never in the text

    def special_marker(self, tokenizer) -> int | None:
        return None  # the calls are read off the ids: the text keeps no special token

    @staticmethod
    def call_from_body(name: str, body: str) -> ToolCall | None:
        """A call of ``name`` whose arguments are ``body``, or None when the body is not a JSON object."""
        try:
            args = json.loads(body)
        except ValueError:
            return None
        return ToolCall(name, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None

    def forced_grammar(self, tools: list[dict], parallel: bool, tokenizer) -> str:
        """Free analysis messages (the model reasons first), then one call of one of ``tools``, as the
        harmony format writes a call: one per turn whatever ``parallel`` says, since ``<|call|>`` ends it."""
        m = harmony_markers(tokenizer)
        calls = [f'{m[CHANNEL]} {_lark_literal("commentary to=functions." + t["function"]["name"] + " ")} '
                 f'{m[CONSTRAIN]} "json" {m[MESSAGE]} %json {json.dumps(_compact(call_args_schema(t)))} {m[CALL]}'
                 for t in tools]
        return harmony_grammar(tokenizer, " | ".join(f"({c})" for c in calls))


def call_args_schema(tool: dict) -> dict:
    """The JSON schema of ``tool``'s arguments (an object with any keys when it declares none)."""
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _compact(schema: dict) -> dict:
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


def harmony_markers(tokenizer) -> dict[str, str]:
    """The harmony markers as Lark tokens (``<[id]>``); ValueError names a missing one."""
    out = {}
    for name in (CHANNEL, MESSAGE, END, START, CONSTRAIN, CALL):
        tid = tokenizer.token_to_id(name)
        if tid is None:
            raise ValueError(f"the tokenizer has no {name} token, which the harmony format needs")
        out[name] = f"<[{tid}]>"
    return out


def harmony_grammar(tokenizer, body: str) -> str:
    """A grammar of a harmony reply: any number of free analysis messages, then the message ``body`` (its
    header included), so that constrained decoding applies to the answer's message only."""
    m = harmony_markers(tokenizer)
    return (f"start: analysis* answer\n"
            f"analysis: {m[CHANNEL]} \"analysis\" {m[MESSAGE]} ANALYSIS_TEXT {m[END]} {m[START]} \"assistant\"\n"
            f"ANALYSIS_TEXT: /(?s:.*)/\n"  # any text: the special tokens are not text, so <|end|> ends it
            f"answer: {body}\n")


PARSERS: dict[str, ToolParser] = {p.family: p for p in (HermesToolParser(), MistralToolParser(), HarmonyToolParser())}


def parser_for(chat_template: str) -> ToolParser | None:
    """The family whose tool-call marker the chat template writes, or None."""
    return next((p for p in PARSERS.values() if p.detect(chat_template)), None)


class ToolCallStream:
    """Splits streamed text into content deltas and complete tool calls (see the module docstring)."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel
        self.text = ""  # everything fed
        self.emitted = 0  # characters of text streamed as content
        self.sent = 0  # calls sent
        self.at: int | None = None  # where the start marker is, once seen

    def feed(self, delta: str, final: bool = False, calls: list[ToolCall] = ()) -> tuple[str, list[ToolCall]]:
        """Add generated text -> (content to stream now, calls completed now). ``final``: the last feed;
        calls that turn out malformed are then streamed as content. ``calls``: the delta's calls, for a
        structured family (harmony), whose text is all content."""
        if self.parser.structured:
            new = list(calls) if self.parallel else list(calls)[:max(0, 1 - self.sent)]
            self.sent += len(new)
            return delta, new
        self.text += delta
        if self.at is None:
            at = self.text.find(self.parser.start, self.emitted)
            if at >= 0:
                self.at = at
            else:
                hold = len(self.text) if final else _marker_prefix_start(self.text, self.parser.start, self.emitted)
                content, self.emitted = self.text[self.emitted:hold], hold
                return content, []
        content, self.emitted = self.text[self.emitted:self.at], max(self.emitted, self.at)
        calls = self.parser.calls(self.text[self.at:], final)
        if calls is None:  # malformed at the end: it was text after all
            if self.sent:
                return content, []
            content, self.emitted = content + self.text[self.emitted:], len(self.text)
            return content, []
        new = calls[self.sent:] if self.parallel else calls[self.sent:1]  # not parallel: the first call only
        self.sent += len(new)
        return content, new


def _marker_prefix_start(text: str, marker: str, start: int) -> int:
    """Where the longest tail of ``text[start:]`` that is a proper prefix of ``marker`` begins."""
    for k in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:k]):
            return len(text) - k
    return len(text)

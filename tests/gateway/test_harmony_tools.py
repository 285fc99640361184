"""Harmony (gpt-oss) tool calls, unit-wise: calls parsed off the token ids (both header forms, several,
malformed ones left as content, any cut of the stream), the generation's deltas and the OpenAI /
Anthropic answers built from them, the grammars of a forced call and of response_format checked with
llguidance on token sequences, and the chat template rendered as transformers renders it."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.tokenizer import Tokenizer
from services.gateway import generation as g
from services.gateway.chat_tools import ToolPlan, answer_message
from services.gateway.reasoning import harmony_splitter
from services.gateway.tool_parsers import HarmonyToolParser, ToolCall, ToolCallStream, parser_for
from tests.gateway.harmony_model import HARMONY_TEMPLATE, write_harmony_tokenizer

PARSER = HarmonyToolParser()
ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather; call the tool.<|end|>"
PREAMBLE = "<|start|>assistant<|channel|>commentary<|message|>Checking the weather.<|end|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
        '{"city":"Paris","unit":"celsius"}<|call|>')
CALL_IN_ROLE = '<|start|>assistant to=functions.add<|channel|>commentary json<|message|>{"a": 2, "b": 3}<|call|>'
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 10}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b"}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    d = tmp_path_factory.mktemp("harmony")
    write_harmony_tokenizer(d)
    return Tokenizer.from_dir(d)


def _parse(tok: Tokenizer, text: str, cuts: tuple[int, ...] = ()) -> tuple[str, str, list[ToolCall]]:
    """(reasoning, answer, calls) of a reply fed in pieces cut at ``cuts``, then finished."""
    ids = tok.encode(text)
    splitter = harmony_splitter(tok, PARSER.call_from_body)
    reasoning, answer, calls = [], [], []
    bounds = [0, *cuts, len(ids)]
    for a, b in zip(bounds, bounds[1:]):
        p = splitter.feed(ids[a:b])
        reasoning, answer, calls = reasoning + p.reasoning, answer + p.answer, calls + p.calls
    end = splitter.finish()
    return tok.decode(reasoning), tok.decode(answer + end.answer), calls + end.calls


def test_the_template_is_harmony(tok):
    from services.gateway.chat_tools import plan_tools
    from services.gateway.protocol import ChatCompletionRequest

    assert isinstance(parser_for(HARMONY_TEMPLATE), HarmonyToolParser)
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    plan = plan_tools(req, tok.tokenizer_config, tok)
    # auto: no grammar, and the answer's text is decoded without special tokens (the calls come off the ids)
    assert plan.parser.family == "harmony" and plan.grammar is None and not plan.keep_special_tokens


def test_a_call_after_reasoning_and_a_preamble(tok):
    reasoning, answer, calls = _parse(tok, ANALYSIS + PREAMBLE + CALL)
    assert reasoning == "The user wants the weather; call the tool."
    assert answer == "Checking the weather."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_recipient_in_the_role_and_several_calls(tok):
    """``to=`` before ``<|channel|>`` (as the template writes earlier calls) and two calls in one reply."""
    _, answer, calls = _parse(tok, CALL + CALL_IN_ROLE)
    assert answer == "" and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 2, "b": 3}


def test_the_engine_consumed_call_token_ends_the_last_call(tok):
    """The engine stops on <|call|> (EOS) and the gateway drops it: finish() ends the message."""
    _, _, calls = _parse(tok, ANALYSIS + CALL.removesuffix("<|call|>"))
    assert [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("body", ['{"city": "Par', "[1, 2]", "not json"])
def test_a_malformed_call_is_content(tok, body):
    """Arguments that are not a JSON object (cut by max_tokens, an array, text): the body is the answer's
    text, as the text parsers leave a malformed call as content; a well-formed call beside it stays a call."""
    bad = f"<|start|>assistant<|channel|>commentary to=functions.add <|constrain|>json<|message|>{body}"
    _, answer, calls = _parse(tok, CALL + bad)
    assert answer == body and [c.name for c in calls] == ["get_weather"]


def test_every_cut_of_the_stream_gives_the_same_parts(tok):
    text = ANALYSIS + PREAMBLE + CALL + CALL_IN_ROLE
    whole = _parse(tok, text)
    n = len(tok.encode(text))
    for cut in range(n + 1):
        assert _parse(tok, text, (cut,)) == whole
    for cut in range(0, n, 3):
        assert _parse(tok, text, tuple(range(cut, n, 5))) == whole


def test_without_make_call_addressed_bodies_are_text(tok):
    """tool_choice "none" (or no tools): nothing is parsed, the call's body is answer text."""
    ids = tok.encode(CALL)
    parts = harmony_splitter(tok).feed(ids)
    assert tok.decode(parts.answer) == '{"city":"Paris","unit":"celsius"}' and parts.calls == []


def test_other_recipients_are_not_function_calls(tok):
    """A builtin tool (``to=python``, ``to=browser.search``) is no function of the request: its body is text."""
    _, answer, calls = _parse(tok, "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>")
    assert answer == "{}" and calls == []


class _Client:
    id = "engine-0"

    async def abort(self, request_id, reason):
        raise AssertionError("nothing to abort here")


class _Engine:
    def __init__(self, tokenizer):
        self.tokenizer, self.client, self.outstanding = tokenizer, _Client(), 1


def _run(tok: Tokenizer, text: str, step: int) -> tuple[g.Generation, list[g.Delta]]:
    """The generation's deltas for an engine that streams ``text`` ``step`` ids at a time, ending on <|call|>."""
    stop = tok.token_to_id("<|call|>")
    ids = tok.encode(text.removesuffix("<|call|>")) + [stop]
    chunks = [ids[i:i + step] for i in range(0, len(ids), step)]

    async def stream():
        for i, part in enumerate(chunks):
            last = i == len(chunks) - 1
            yield {"token_ids": part, **({"finish_reason": "stop", "stop_token_id": stop} if last else {})}

    gen = g.Generation(_Engine(tok), [1, 2], {}, [], make_call=PARSER.call_from_body)

    async def run():
        return [d async for d in g.deltas(gen, stream())]

    return gen, asyncio.run(run())


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_deltas_carry_calls_apart_from_text_and_reasoning(tok, step):
    gen, out = _run(tok, ANALYSIS + PREAMBLE + CALL, step)
    assert "".join(d.reasoning for d in out) == gen.reasoning == "The user wants the weather; call the tool."
    assert "".join(d.text for d in out) == gen.text == "Checking the weather."
    assert [c.name for d in out for c in d.calls] == [c.name for c in gen.calls] == ["get_weather"]
    assert out[-1].finish_reason == "stop" and out[-1].calls  # the call completes with the stop token


def test_openai_message_and_stream(tok):
    gen, out = _run(tok, ANALYSIS + PREAMBLE + CALL, 3)
    plan = ToolPlan(TOOLS, PARSER, parallel=True)
    message, finish = answer_message(plan, gen.text, gen.finish_reason, gen.calls)
    assert finish == "tool_calls" and message.content == "Checking the weather."
    assert message.tool_calls[0].function.name == "get_weather" and message.tool_calls[0].id.startswith("call_")
    stream = ToolCallStream(PARSER, parallel=True)
    fed = [stream.feed(d.text, d.finish_reason is not None, d.calls) for d in out]
    assert "".join(t for t, _ in fed) == "Checking the weather."
    assert [c.name for _, cs in fed for c in cs] == ["get_weather"]
    # no calls: the answer is all content and the finish_reason stays
    message, finish = answer_message(plan, "Hello", "stop", [])
    assert (message.content, message.tool_calls, finish) == ("Hello", None, "stop")


def test_parallel_off_keeps_the_first_call(tok):
    gen, out = _run(tok, CALL + CALL_IN_ROLE, 2)
    plan = ToolPlan(TOOLS, PARSER, parallel=False)
    message, _ = answer_message(plan, gen.text, gen.finish_reason, gen.calls)
    assert [c.function.name for c in message.tool_calls] == ["get_weather"] and message.content is None
    stream = ToolCallStream(PARSER, parallel=False)
    sent = [c.name for d in out for c in stream.feed(d.text, d.finish_reason is not None, d.calls)[1]]
    assert sent == ["get_weather"]


def test_anthropic_tool_use_blocks(tok):
    from services.gateway.serving_anthropic import _content

    gen, _ = _run(tok, ANALYSIS + PREAMBLE + CALL, 5)
    blocks, finish = _content(ToolPlan(TOOLS, PARSER), gen)
    assert finish == "tool_calls"
    assert blocks[0] == {"type": "text", "text": "Checking the weather."}
    assert blocks[1]["type"] == "tool_use" and blocks[1]["name"] == "get_weather"
    assert blocks[1]["input"] == {"city": "Paris", "unit": "celsius"}


# -- grammars: checked token by token with llguidance against the tokenizer ----------------------------
def _matcher(tok: Tokenizer, lark: str):
    import llguidance

    lt = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_ids)
    m = llguidance.LLMatcher(lt, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def _accepts(tok: Tokenizer, lark: str, text: str, complete: bool = True) -> bool:
    m = _matcher(tok, lark)
    for t in tok.encode(text):
        if not m.consume_token(t):
            return False
    return m.is_accepting() if complete else True


def test_forced_call_grammar(tok):
    lark = PARSER.forced_grammar(TOOLS, True, tok)
    call = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>')
    assert _accepts(tok, lark, call)
    assert _accepts(tok, lark, ANALYSIS + "<|start|>assistant" + call)  # the model may reason first
    assert _accepts(tok, lark, '<|channel|>commentary to=functions.add <|constrain|>json<|message|>{"x":[1]}<|call|>')
    assert not _accepts(tok, lark, '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                                   '{"city":"Rome","zip":1}', complete=False)  # not under the schema
    assert not _accepts(tok, lark, "<|channel|>final<|message|>Hi", complete=False)  # no answer without a call
    only_add = PARSER.forced_grammar(TOOLS[1:], False, tok)
    assert not _accepts(tok, only_add, call, complete=False)  # a named function: no other


def test_response_format_grammar_constrains_the_final_message(tok):
    from services.gateway.protocol import ResponseFormat
    from services.gateway.structured_output import grammar_for_response_format

    fmt = ResponseFormat(type="json_schema", json_schema={"name": "w", "schema": WEATHER})
    lark = grammar_for_response_format(fmt, tok)["lark"]
    assert _accepts(tok, lark, '<|channel|>final<|message|>{"city":"Oslo"}')
    assert _accepts(tok, lark, ANALYSIS + '<|start|>assistant<|channel|>final<|message|>{"city":"Oslo"}')
    assert not _accepts(tok, lark, '<|channel|>final<|message|>{"town":"Oslo"}', complete=False)
    assert not _accepts(tok, lark, '{"city":"Oslo"}', complete=False)  # the channel header comes first
    any_object = grammar_for_response_format(ResponseFormat(type="json_object"), tok)["lark"]
    assert _accepts(tok, any_object, '<|channel|>final<|message|>{"k":[1,2]}')
    # a tokenizer without the markers keeps the plain JSON grammar
    assert grammar_for_response_format(fmt, None) == {"json_schema": WEATHER}


# -- the chat template -------------------------------------------------------------------------------
def _conversation() -> list[dict]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [{"role": "developer", "content": "Answer briefly."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": "Call the tool.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "assistant", "content": "21 degrees."},
            {"role": "user", "content": "And 2 + 3?"}]


@pytest.mark.parametrize("effort", [None, "low", "high"])
def test_gateway_renders_the_conversation_as_transformers(tok, tmp_path, effort):
    """The gateway's messages (tool_calls' arguments as objects, reasoning_content as thinking) rendered by
    our sandbox equal transformers' apply_chat_template of the same messages, tools and reasoning_effort."""
    from transformers import AutoTokenizer

    from services.common.chat_template import render_chat
    from services.gateway.protocol import ChatCompletionRequest
    from services.gateway.serving_chat import _messages, with_reasoning_effort

    write_harmony_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    messages = _messages(ChatCompletionRequest(model="m", messages=_conversation()))
    kwargs = with_reasoning_effort(effort, tok.tokenizer_config, TOOLS, {}) if effort else {}
    ours = render_chat(tok.tokenizer_config, messages, tools=TOOLS, **kwargs)
    theirs = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours == theirs
    assert f"Reasoning: {effort or 'medium'}\n" in ours
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>'
            '"{\\"temp\\": 21}"<|end|>') in ours


def test_reasoning_effort_is_refused_where_the_template_has_none(tok):
    from services.engine.models.demo import CHAT_TEMPLATE
    from services.gateway.serving_chat import with_reasoning_effort

    with pytest.raises(g.RequestError, match="no reasoning_effort variable") as e:
        with_reasoning_effort("low", {"chat_template": CHAT_TEMPLATE}, None, {})
    assert e.value.body["error"]["param"] == "reasoning_effort"
    with pytest.raises(g.RequestError, match="one of low, medium, high"):
        with_reasoning_effort("extreme", tok.tokenizer_config, None, {})
    with pytest.raises(g.RequestError, match="disagree"):
        with_reasoning_effort("low", tok.tokenizer_config, None, {"reasoning_effort": "high"})
    assert with_reasoning_effort("low", tok.tokenizer_config, None, {"reasoning_effort": "low"}) == {
        "reasoning_effort": "low"}


def test_anthropic_stream_sends_the_call_as_a_tool_use_block(tok):
    """/v1/messages streamed: the preamble as a text block, then the call as a tool_use block whose
    input_json_delta is its arguments, stop_reason tool_use."""
    from services.gateway.serving_anthropic import _events

    stop = tok.token_to_id("<|call|>")
    ids = tok.encode((ANALYSIS + PREAMBLE + CALL).removesuffix("<|call|>")) + [stop]

    async def stream():
        for i in range(0, len(ids), 4):
            last = i + 4 >= len(ids)
            yield {"token_ids": ids[i:i + 4], **({"finish_reason": "stop", "stop_token_id": stop} if last else {})}

    gen = g.Generation(_Engine(tok), [1, 2], {}, [], make_call=PARSER.call_from_body)

    async def run():
        return [e async for e in _events(gen, ToolPlan(TOOLS, PARSER), stream(), "msg_1", "m")]

    events = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(run())]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in starts] == ["text", "tool_use"] and starts[1]["name"] == "get_weather"
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "text_delta")
    args = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                   and e["delta"]["type"] == "input_json_delta")
    assert text == "Checking the weather." and json.loads(args) == {"city": "Paris", "unit": "celsius"}
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]

"""Tool-call parsers (services/gateway/tool_parsers.py) on strings in the families' real formats, the
streaming splitter against the one-shot parse at every split point, and the forced-call grammars
checked by llguidance against the demo tokenizer (a right call is accepted, a wrong one is not)."""

from __future__ import annotations

import json

import llguidance
import pytest

from services.common.tokenizer import Tokenizer
from services.engine.models.demo import CHAT_TEMPLATE, write_tokenizer_files
from services.gateway.chat_tools import plan_tools
from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tool_parsers import PARSERS, ToolCallStream, parser_for

# What Qwen3 writes (its chat template's format; the <think> block is Qwen3's reasoning, empty here).
QWEN3 = ('<think>\n\n</think>\n\nLet me check both cities.\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": '
         '{"city": "Zürich", "unit": "celsius"}}\n</tool_call>')
MIXTRAL = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"name": "add", "arguments": {"a": 1}}]')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
             "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add"}}]


def test_family_is_chosen_by_the_chat_template():
    assert parser_for(CHAT_TEMPLATE).family == "hermes"
    assert parser_for("{{ '[TOOL_CALLS] ' + tool_calls | tojson }}").family == "mistral"
    assert parser_for("{{ messages[0].content }}") is None


def test_qwen3_output_parses_into_calls():
    content, calls = PARSERS["hermes"].parse(QWEN3)
    assert content == "<think>\n\n</think>\n\nLet me check both cities."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Zürich", "unit": "celsius"})]
    only_call = QWEN3[QWEN3.index("<tool_call>"):]
    assert PARSERS["hermes"].parse(only_call)[0] is None


MALFORMED = ["Just text, no call.", "<tool_call>\n{not json}\n</tool_call>",
             '<tool_call>\n{"arguments": {}}\n</tool_call>', "<tool_call>\n{\"name\": \"f\""]


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_calls_stay_text(text):
    assert PARSERS["hermes"].parse(text) == (text, [])


def test_a_call_cut_by_max_tokens_keeps_the_complete_ones():
    content, calls = PARSERS["hermes"].parse(QWEN3 + '\n<tool_call>\n{"name": "get_wea')
    assert len(calls) == 2


def test_mixtral_output_parses_into_calls():
    content, calls = PARSERS["mistral"].parse("Sure. " + MIXTRAL)
    assert content == "Sure." and [c.name for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1].arguments) == {"a": 1}
    assert len(PARSERS["mistral"].new_id()) == 9 and PARSERS["mistral"].new_id().isalnum()


@pytest.mark.parametrize("family,text", [("hermes", QWEN3), ("mistral", MIXTRAL), ("hermes", "plain <tool text"),
                                         *(("hermes", t) for t in MALFORMED), ("mistral", "[TOOL_CALLS] [{]")])
def test_streaming_equals_parse_at_every_split(family, text):
    parser = PARSERS[family]
    want_content, want_calls = parser.parse(text)
    for split in range(len(text) + 1):
        stream = ToolCallStream(parser)
        pieces = [stream.feed(text[:split]), stream.feed(text[split:], final=True)]
        content = "".join(c for c, _ in pieces)
        calls = [c for _, cs in pieces for c in cs]
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in want_calls]
        if want_calls:
            assert content.strip() == (want_content or "")
            assert "<tool_call>" not in content and "[TOOL_CALLS]" not in content
        else:
            assert content == text


def test_streaming_without_parallel_calls_sends_the_first_only():
    stream = ToolCallStream(PARSERS["hermes"], parallel=False)
    calls = stream.feed(QWEN3)[1] + stream.feed("", final=True)[1]
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris"]


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(d)
    tok = Tokenizer.from_dir(d)
    return tok, llguidance.LLTokenizer((d / "tokenizer.json").read_text())


def _accepts(grammar: str, llg_tok, text: str, tok: Tokenizer) -> bool:
    matcher = llguidance.LLMatcher(llg_tok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


def test_hermes_forced_grammar_accepts_exactly_the_calls(demo_tokenizer):
    tok, llg_tok = demo_tokenizer
    parser = PARSERS["hermes"]
    call = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}\n</tool_call>'
    two = call + '\n<tool_call>\n{"name":"add","arguments":{}}\n</tool_call>'
    parallel, single = parser.forced_grammar(TOOLS, True, tok), parser.forced_grammar(TOOLS[:1], False, tok)
    assert _accepts(parallel, llg_tok, call, tok) and _accepts(parallel, llg_tok, two, tok)
    assert _accepts(single, llg_tok, call, tok) and not _accepts(single, llg_tok, two, tok)
    assert not _accepts(single, llg_tok, call.replace("Paris", "Paris\",\"x\":\"1"), tok)  # not in the schema
    assert not _accepts(parallel, llg_tok, call.replace("get_weather", "get_time"), tok)
    assert not _accepts(parallel, llg_tok, "Sure! " + call, tok)


def test_mistral_forced_grammar(demo_tokenizer):
    tok, llg_tok = demo_tokenizer
    grammar = PARSERS["mistral"].forced_grammar(TOOLS, True, tok)
    assert _accepts(grammar, llg_tok, '[TOOL_CALLS] [{"name":"add","arguments":{}}]', tok)
    assert not _accepts(grammar, llg_tok, '[TOOL_CALLS] []', tok)


def test_a_special_marker_token_is_forced_by_id_and_kept_in_the_text(tmp_path):
    """Mistral's [TOOL_CALLS] is a special token: the forced grammar names it by id (text cannot spell
    it), and the answer must be decoded with special tokens kept or the call disappears."""
    write_tokenizer_files(tmp_path)
    tok = Tokenizer.from_dir(tmp_path)
    tok.backend.add_special_tokens(["[TOOL_CALLS]"])
    (tmp_path / "tokenizer.json").write_text(tok.backend.to_str())
    tok = Tokenizer.from_dir(tmp_path)
    marker = tok.token_to_id("[TOOL_CALLS]")
    parser = PARSERS["mistral"]
    assert parser.special_marker(tok) == marker and PARSERS["hermes"].special_marker(tok) is None
    grammar = parser.forced_grammar(TOOLS, False, tok)
    assert f"<[{marker}]>" in grammar
    ids = [marker] + tok.encode(' [{"name":"add","arguments":{}}]')
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer((tmp_path / "tokenizer.json").read_text()),
                                   llguidance.LLMatcher.grammar_from_lark(grammar))
    assert matcher.consume_tokens(ids) and matcher.is_accepting()
    assert [c.name for c in parser.parse(tok.decode(ids, skip_special_tokens=False))[1]] == ["add"]
    assert parser.parse(tok.decode(ids, skip_special_tokens=True))[1] == []
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                tool_choice="required")
    plan = plan_tools(req, {"chat_template": "{{ '[TOOL_CALLS] ' }}"}, tok)  # a Mistral-style template
    assert plan.parser is parser and plan.keep_special_tokens and f"<[{marker}]>" in plan.grammar["lark"]

"""gpt-oss's chat format end to end: the real `openai` and `anthropic` clients against `tandem serve` on a
tiny random gpt-oss checkpoint with a harmony tokenizer and template (tests/gateway/harmony_model.py).
Random weights never call a tool by themselves, so a call is forced (tool_choice), which the grammar
writes in the harmony format; what is checked is the path: the prompt is transformers' rendering of the
same conversation, the call comes back as tool_calls / tool_use with arguments under the schema,
reasoning apart, streamed and not, and reasoning_effort reaches the template."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.gateway.harmony_model import write_tiny_gpt_oss

KEY = "sk-gpt-oss"
MODEL = "tiny-gpt-oss"
CITY = {"type": "object", "additionalProperties": False, "required": ["city"],
        "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]}}}
SUM = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                      "b": {"type": "integer", "minimum": 0, "maximum": 9}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": SUM}}]
SCHEMAS = {"get_weather": CITY, "add": SUM}
MESSAGES = [{"role": "developer", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_gpt_oss(tmp_path_factory.mktemp("tiny-gpt-oss"))


@pytest.fixture(scope="module")
def server(serve_process, ckpt):
    return serve_process("--model", str(ckpt), "--served-model-name", MODEL, "--max-seq-len", "2048",
                         "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


def _hf_len(hf, messages, **kw) -> int:
    ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **kw)
    return len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _steer(hf, channel: str) -> dict:
    """Random weights would reason (analysis) until max_tokens: a logit_bias that ends any analysis at once
    (<|end|>) and prefers ``channel``'s first letter after <|channel|> (the grammar allows nothing else
    there but "analysis" and the answer's channel), so the grammar's answer message comes quickly."""
    end, letter = hf.convert_tokens_to_ids("<|end|>"), hf.convert_tokens_to_ids(channel[0])
    return {"logit_bias": {str(end): 100, str(letter): 50}, "temperature": 0, "max_tokens": 120}


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_prompt_is_transformers_rendering_with_reasoning_effort(client, hf):
    for effort in ("low", "medium"):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=2,
                                           reasoning_effort=effort)
        assert r.usage.prompt_tokens == _hf_len(hf, MESSAGES, tools=TOOLS, reasoning_effort=effort)
    # the two prompts differ in length here, so equal counts mean the effort did reach the template
    assert _hf_len(hf, MESSAGES, reasoning_effort="medium") != _hf_len(hf, MESSAGES, reasoning_effort="low")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="minimal")
    assert e.value.body["param"] == "reasoning_effort"


def test_forced_named_call(client, hf):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       **_steer(hf, "commentary"))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_") and choice.message.content is None
    _check_call(call.function.name, call.function.arguments)


def test_forced_call_streaming_and_round_trip(client, hf):
    chunks = [c for c in client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS,
                                                        tool_choice="required", stream=True,
                                                        **_steer(hf, "commentary")) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [tc for c in chunks for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and {d.index for d in deltas} == {0} and deltas[0].id.startswith("call_")
    name = deltas[0].function.name
    arguments = "".join(d.function.arguments or "" for d in deltas)
    _check_call(name, arguments)
    # the call and its result go back through the template as transformers renders them
    call = {"id": deltas[0].id, "type": "function", "function": {"name": name, "arguments": arguments}}
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": deltas[0].id, "content": "sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=2)
    hf_history = [*history[:2], {"role": "assistant", "tool_calls": [
        {**call, "function": {"name": name, "arguments": json.loads(arguments)}}]}, history[-1]]
    assert r.usage.prompt_tokens == _hf_len(hf, hf_history, tools=TOOLS)


def test_response_format_constrains_the_final_message(client, hf):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, **_steer(hf, "final"))
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), CITY)


def test_auto_tools_answer_text_and_reasoning_apart(client):
    """Unforced, random weights write what they write: the answer's shape holds (no markers in the text)."""
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=24, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert "<|" not in (message.content or "") + (getattr(message, "reasoning_content", None) or "")


def test_anthropic_tool_round_trip(server, hf):
    """tool_use / tool_result blocks of /v1/messages render as the same conversation's chat messages do."""
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=300)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    m = client.messages.create(model=MODEL, max_tokens=4, system="Use the tools.", tools=tools, messages=messages)
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")
    chat = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == _hf_len(hf, chat, tools=TOOLS)

"""Tool calling and structured output through the real `openai` client against `tandem gateway` +
`tandem engine` over HTTP (demo model, random weights): only the grammar can make the output valid, so
every answer is checked with `jsonschema` against the schema it was asked for. The schemas bound their
strings and numbers so that random weights finish well within max_tokens."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

API_KEY = "sk-test-key"
MODEL = "tandem-demo"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
REPORT = {"type": "object", "additionalProperties": False, "required": ["title", "score", "ok", "tags"],
          "properties": {"title": {"type": "string", "maxLength": 16},
                         "score": {"type": "number", "minimum": 0, "maximum": 10},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}}


@pytest.fixture(scope="module")
def client(engine_process, gateway_process) -> openai.OpenAI:
    engine = engine_process("--model", "demo", "--max-seq-len", "2048", "--max-running-requests", "4")
    gateway = gateway_process("--engine", engine.url, "--api-key", API_KEY, "--health-interval-s", "0.5")
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _stream(client, **kwargs) -> tuple[list, str | None]:
    chunks = [c for c in client.chat.completions.create(model=MODEL, stream=True, **kwargs) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant" and len({c.id for c in chunks}) == 1
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    return chunks, chunks[-1].choices[0].finish_reason


def test_json_schema_output_validates_even_on_random_weights(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "report", "schema": REPORT, "strict": True}}
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format=fmt, max_tokens=300,
                                       temperature=1.0, seed=7)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), REPORT)
    chunks, finish = _stream(client, messages=MESSAGES, response_format=fmt, max_tokens=300, temperature=0)
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), REPORT)


def test_json_object_output_parses(client):
    """Any JSON object: nothing bounds its strings, so on random weights an answer may run into max_tokens
    (finish_reason "length", as OpenAI's JSON mode does); every answer that stopped must parse, and the
    small choice after each value ("," or "}") makes some of the seeds stop."""
    finished = 0
    for seed in range(4):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"},
                                           max_tokens=60, temperature=1.0, seed=seed)
        if r.choices[0].finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        else:
            assert r.choices[0].message.content.startswith("{")
    assert finished > 0


def _check_call(name: str, arguments: str) -> None:
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_tool_call_non_streaming(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=3)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in SCHEMAS
    _check_call(call.function.name, call.function.arguments)


def test_named_tool_call_streaming(client):
    chunks, finish = _stream(client, messages=MESSAGES, tools=TOOLS, max_tokens=300, temperature=1.0, seed=5,
                             tool_choice={"type": "function", "function": {"name": "add"}})
    assert finish == "tool_calls"
    deltas = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert deltas and {t.index for t in deltas} == {0}
    assert deltas[0].id and deltas[0].type == "function" and deltas[0].function.name == "add"
    _check_call("add", "".join(t.function.arguments or "" for t in deltas))
    assert not any(c.choices[0].delta.content for c in chunks)


def test_tool_round_trip_renders_through_the_chat_template(client, demo_dir):
    """An assistant turn with tool_calls (arguments as OpenAI's JSON text) and the tool's answer: the prompt
    must be what transformers' apply_chat_template makes of the same conversation (arguments as objects)."""
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    messages = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=1, temperature=0)
    hf = AutoTokenizer.from_pretrained(str(demo_dir))
    hf_messages = [*MESSAGES, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}, messages[-1]]
    ids = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert r.usage.prompt_tokens == len(ids)
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text


def test_tool_choice_none_and_auto_answer_text(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           max_tokens=8, temperature=0)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("kwargs,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     None, "objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema",
     "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "json_object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "response_format"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "unique"),
])
def test_requests_that_cannot_be_honoured_are_refused(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, **kwargs)
    body = err.value.body
    assert words in body["message"] and (param is None or body["param"] == param), body

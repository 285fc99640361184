"""POST /v1/messages with the real `anthropic` SDK against `tandem serve` (demo model): the same tokens
as the OpenAI endpoint for the same conversation, Anthropic's stream events in order, stop sequences,
usage, x-api-key, and fields refused by name in Anthropic's error shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

KEY = "sk-anthropic"
MODEL = "tandem-demo"
SYSTEM = "You are a sailor."
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"extra_body": {"temperature": 0}}  # no longer in the newest SDK's types; Tandem honours it


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process("--model", "demo", "--max-seq-len", "1024", "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _openai_twin(oai, max_tokens: int, **kw):
    return oai.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES],
                                       max_tokens=max_tokens, temperature=0, **kw)


def test_message_matches_the_openai_endpoint(client, oai):
    m = client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=MESSAGES, **GREEDY)
    twin = _openai_twin(oai, 12)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_") and m.model == MODEL
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == twin.choices[0].message.content
    assert m.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[twin.choices[0].finish_reason]
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == twin.usage.prompt_tokens
    assert m.usage.output_tokens == twin.usage.completion_tokens
    blocks = client.messages.create(model=MODEL, max_tokens=12, messages=MESSAGES, **GREEDY,
                                    system=[{"type": "text", "text": SYSTEM}])
    assert blocks.content[0].text == m.content[0].text  # system as text blocks: the same prompt


def test_stream_events_in_anthropic_order(client, server):
    with client.messages.stream(model=MODEL, max_tokens=10, system=SYSTEM, messages=MESSAGES,
                                **GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    whole = client.messages.create(model=MODEL, max_tokens=10, system=SYSTEM, messages=MESSAGES, **GREEDY)
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    body = {"model": MODEL, "max_tokens": 5, "messages": MESSAGES, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        events = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    deltas = events[3:-3]
    assert events[:3] == ["message_start", "ping", "content_block_start"]
    assert deltas and set(deltas) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_stop_sequence_names_the_match(client):
    base = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, **GREEDY).content[0].text
    assert len(base) > 10, base
    stop = base[5:8]
    m = client.messages.create(model=MODEL, max_tokens=24, messages=MESSAGES, stop_sequences=[stop], **GREEDY)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == base[:base.index(stop)]


def test_keys_are_checked(server):
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=MESSAGES)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(server.url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": MESSAGES},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("extra,named", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"extra_body": {"top_logprobs": 3}}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "messages"),
    ({"model": "nope"}, "nope"),
])
def test_refusals_name_the_field_in_anthropic_shape(client, extra, named):
    kw = {"model": MODEL, "max_tokens": 4, "messages": MESSAGES, **extra}
    with pytest.raises((anthropic.BadRequestError, anthropic.NotFoundError)) as err:
        client.messages.create(**kw)
    body = err.value.body
    assert body["type"] == "error" and named in body["error"]["message"], body


def test_neutral_values_pass(client):
    m = client.messages.create(model=MODEL, max_tokens=3, messages=MESSAGES, thinking={"type": "disabled"},
                               tools=[], metadata={"user_id": "u1"}, service_tier="auto")
    assert m.usage.output_tokens <= 3
    assert json.loads(m.model_dump_json())["content"][0]["type"] == "text"


WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "days": {"type": "integer", "minimum": 1,
                                                                      "maximum": 7}},
                            "required": ["city", "days"], "additionalProperties": False}}


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_forced_tool_use_validates_against_its_schema(client, choice):
    import jsonschema

    kw = dict(model=MODEL, max_tokens=200, messages=MESSAGES, tools=[WEATHER], tool_choice=choice, **GREEDY)
    m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather" and uses[0].id
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])
    with client.messages.stream(**kw) as stream:  # streamed: the same call, as input_json_delta
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [(u.name, u.input) for u in uses]


def test_tool_round_trip_renders_as_the_openai_endpoint(client, oai):
    turns = [*MESSAGES,
             {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                               {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                "input": {"city": "Oslo", "days": 2}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                           "content": [{"type": "text", "text": "Rain."}]}]}]
    m = client.messages.create(model=MODEL, max_tokens=8, messages=turns, tools=[WEATHER], **GREEDY)
    fn = {"name": "get_weather", "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}
    twin = oai.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0, tools=[{"type": "function", "function": fn}],
        messages=[*MESSAGES, {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Rain."}])
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == twin.usage.prompt_tokens
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text == (twin.choices[0].message.content or "")

"""The rule of issue 23: every field of the OpenAI chat and completions request is either honoured or
refused with a 400 naming it. Checked three ways: the request models declare every field of the
`openai` SDK's own request types (and nothing undeclared gets through), the field table
(services/gateway/request_fields.py) covers exactly the declared fields and matches docs/openai-api.md,
and against a real `tandem serve` each field set to a non-neutral value is answered as the table says."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.request_fields import ANTHROPIC_FIELDS, CHAT_FIELDS, COMPLETION_FIELDS, HONOURED, REFUSED
from services.gateway.serving_anthropic import MessagesRequest

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai-api.md"
MODEL = "tandem-demo"
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}}}

# A value that asks for something (not the field's neutral default) for every declared field: a new
# field without one fails test_every_field_has_a_sample, so its behaviour gets decided and tested.
SAMPLES = {
    "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "prompt": "Hello",
    "audio": {"voice": "alloy", "format": "wav"}, "frequency_penalty": 0.5, "function_call": "auto",
    "functions": [TOOL["function"]], "logit_bias": {"5": 1.0}, "logprobs": True, "max_completion_tokens": 3,
    "max_tokens": 3, "metadata": {"purpose": "test"}, "modalities": ["text", "audio"],
    "moderation": {"enabled": True}, "n": 2, "parallel_tool_calls": False, "prediction": {"type": "content",
                                                                                          "content": "x"},
    "presence_penalty": 0.5, "prompt_cache_key": "k1", "prompt_cache_options": {"mode": "x"},
    "prompt_cache_retention": "24h", "reasoning_effort": "low", "response_format": {"type": "json_object"},
    "safety_identifier": "user-1", "seed": 7, "service_tier": "flex", "stop": ["\n\n"], "store": True,
    "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.7, "tool_choice": "auto",
    "tools": [TOOL], "top_logprobs": 2, "top_p": 0.9, "user": "user-1", "verbosity": "low",
    "web_search_options": {}, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2,
    "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}, "best_of": 2, "echo": True,
    "suffix": " the end",
}
COMPLETION_SAMPLES = {"logprobs": 2}  # an int there, a boolean in chat
COMPANIONS = {"top_logprobs": {"logprobs": True}}  # fields that only mean something with another one
# honoured fields that the demo model cannot honour, refused by name there (its chat template has no
# reasoning_effort variable); tests/gateway/test_gpt_oss_chat.py checks gpt-oss's template takes it
MODEL_REFUSES = {"reasoning_effort"}


def _sdk_fields(module) -> set[str]:
    return set(module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("model,table,sdk", [(ChatCompletionRequest, CHAT_FIELDS, chat_create_params),
                                             (CompletionRequest, COMPLETION_FIELDS, completion_create_params)])
def test_models_declare_every_openai_field_and_the_table_covers_them(model, table, sdk):
    declared = set(model.model_fields)
    assert _sdk_fields(sdk) - declared == set(), "fields of OpenAI's request the model does not declare"
    assert set(table) == declared, "the field table and the request model disagree"
    assert {r.support for r in table.values()} <= {HONOURED, REFUSED}
    assert model.model_config.get("extra") == "forbid"  # an undeclared field is refused, not ignored


def test_anthropic_model_declares_every_sdk_field_and_the_table_covers_them():
    from anthropic.types import message_create_params

    declared = set(MessagesRequest.model_fields)
    sdk = set(message_create_params.MessageCreateParamsBase.__annotations__) | {"stream"}
    assert sdk - declared == set(), "fields of Anthropic's request the model does not declare"
    assert set(ANTHROPIC_FIELDS) == declared
    assert MessagesRequest.model_config.get("extra") == "forbid"


def test_every_field_has_a_sample():
    assert set(CHAT_FIELDS) | set(COMPLETION_FIELDS) <= set(SAMPLES)


def _doc_rows(section: str) -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    body = text.split(section, 1)[1].split("\n## ", 1)[0]
    return {m[0]: (m[1], m[2].strip()) for m in re.findall(r"^\| `(\w+)` \| (\w+) \| (.*) \|$", body, re.M)}


@pytest.mark.parametrize("section,table", [("## Chat completions", CHAT_FIELDS), ("## Completions", COMPLETION_FIELDS),
                                           ("## Anthropic Messages", ANTHROPIC_FIELDS)])
def test_docs_table_matches_the_code(section, table):
    assert _doc_rows(section) == {k: (r.support, r.note.replace("|", "/")) for k, r in table.items()}


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process("--model", "demo", "--max-seq-len", "512")  # a tools prompt is ~380 tokens


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


CASES = [("/v1/chat/completions", name) for name in CHAT_FIELDS] + [("/v1/completions", name)
                                                                    for name in COMPLETION_FIELDS]


@pytest.mark.parametrize("path,name", CASES, ids=[f"{p.rsplit('/', 1)[1]}-{n}" for p, n in CASES])
def test_each_field_is_honoured_or_refused_by_name(server, path, name):
    chat = path.endswith("chat/completions")
    table = CHAT_FIELDS if chat else COMPLETION_FIELDS
    base = {"model": MODEL, "max_tokens": 3, **({"messages": SAMPLES["messages"]} if chat else {"prompt": "Hello"})}
    value = (COMPLETION_SAMPLES if not chat else {}).get(name, SAMPLES[name])
    r = _post(server, path, {**base, **COMPANIONS.get(name, {}), name: value})
    if table[name].support == REFUSED or (chat and name in MODEL_REFUSES):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and name in err["message"], err
    else:
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("path,name", [p for p in CASES if (CHAT_FIELDS if "chat" in p[0] else COMPLETION_FIELDS)[
    p[1]].support == REFUSED], ids=lambda x: x if isinstance(x, str) and not x.startswith("/") else "")
def test_refused_fields_pass_at_their_neutral_value(server, path, name):
    table = CHAT_FIELDS if "chat" in path else COMPLETION_FIELDS
    base = {"model": MODEL, "max_tokens": 2, **({"messages": SAMPLES["messages"]} if "chat" in path else
                                                 {"prompt": "Hello"})}
    for neutral in table[name].neutral:
        r = _post(server, path, {**base, name: neutral})
        assert r.status_code == 200, (neutral, r.text)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_unknown_field_is_refused_by_name(server, path):
    body = {"model": MODEL, "max_tokens": 2, "messages": SAMPLES["messages"], "prompt": "Hello",
            "temprature": 0.5}
    body.pop("prompt" if "chat" in path else "messages")
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "temprature" and "unknown field" in err["message"], err

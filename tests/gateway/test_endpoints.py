"""GET /v1/models/{id}, --served-model-name aliases, /tokenize and /detokenize (vLLM's shapes), API keys
by `Authorization: Bearer` or `x-api-key`: the real `openai` client and httpx against `tandem serve`."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.common.chat_template import render_chat
from services.common.tokenizer import Tokenizer

KEY = "sk-endpoints"
NAMES = ["my-model", "my-alias"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(serve_process):
    return serve_process("--model", "demo", "--max-seq-len", "256", "--api-key", KEY,
                         "--served-model-name", ",".join(NAMES))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(server, demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"} if headers is None else headers)


def test_served_model_names_are_the_models(client, server):
    assert [m.id for m in client.models.list().data] == NAMES
    card = client.models.retrieve("my-alias")
    assert card.id == "my-alias" and card.object == "model" and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("tandem-demo")  # the checkpoint's own id is not a name once names are given
    assert err.value.body["code"] == "model_not_found" and "my-model" in err.value.body["message"]
    info = httpx.get(server.url + "/engine/v1/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert info["model_id"] == "my-model" and info["served_model_names"] == NAMES


def test_every_alias_serves_the_same_model(client):
    outs = [client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True}) for name in NAMES]
    assert outs[0].choices[0].message.content == outs[1].choices[0].message.content
    assert [o.model for o in outs] == NAMES
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="tandem-demo", messages=MESSAGES, max_tokens=2)


def test_tokenize_a_prompt_and_messages(server, client, tokenizer):
    r = _post(server, "/tokenize", {"model": "my-model", "prompt": "Hello there", "return_token_strs": True}).json()
    expected = tokenizer.encode("Hello there", add_special_tokens=True)
    assert r["tokens"] == expected and r["count"] == len(expected) and r["max_model_len"] == 256
    assert r["token_strs"] == [tokenizer.backend.id_to_token(t) for t in expected]
    chat = _post(server, "/tokenize", {"messages": MESSAGES}).json()  # model optional: one model served
    prompt = render_chat(tokenizer.tokenizer_config, MESSAGES, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(prompt) and chat["token_strs"] is None
    usage = client.chat.completions.create(model="my-model", messages=MESSAGES, max_tokens=1).usage
    assert chat["count"] == usage.prompt_tokens  # the same prompt the chat endpoint builds
    no_prompt = _post(server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == tokenizer.encode(render_chat(tokenizer.tokenizer_config, MESSAGES,
                                                               add_generation_prompt=False))


def test_detokenize_round_trips(server, tokenizer):
    ids = tokenizer.encode("The sea was calm.")
    assert _post(server, "/detokenize", {"model": "my-alias", "tokens": ids}).json() == {"prompt": "The sea was calm."}


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_bos": True}, "add_bos"),
    ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ("/detokenize", {"model": "nope", "tokens": [1]}, "model"),
])
def test_tokenize_errors_name_the_field(server, path, body, param):
    r = _post(server, path, body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_keys_by_bearer_or_x_api_key(server):
    body = {"prompt": "Hi"}
    assert _post(server, "/tokenize", body, headers={}).status_code == 401
    assert _post(server, "/tokenize", body, headers={"x-api-key": "sk-wrong"}).status_code == 401
    assert _post(server, "/tokenize", body, headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers={"x-api-key": KEY}, timeout=10).status_code == 200

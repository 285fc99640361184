"""Sampling controls and outputs through the real `openai` client against `tandem gateway` + `tandem
engine` (demo model, fp32 on CPU): n choices, logprobs checked against transformers' own forward of
the same checkpoint, logit_bias, min_tokens, min_p and the penalties doing what their definitions say."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.runtime.kv_cache import BLOCK_SIZE

API_KEY = "sk-sampling"
MODEL = "tandem-demo"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story about the sea."}]
GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def stack(engine_process, gateway_process):
    # prompts prefilled 16 tokens a step: a long prompt spans several steps (test_n_prefills_the_prompt_once)
    engine = engine_process("--model", "demo", "--max-seq-len", "256", "--max-running-requests", "4",
                            "--max-prefill-tokens", "16")
    gateway = gateway_process("--engine", engine.url, "--api-key", API_KEY)
    return engine, gateway


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1].url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(stack, demo_dir) -> Tokenizer:
    return Tokenizer.from_dir(demo_dir)


@pytest.fixture(scope="module")
def hf_model(stack, demo_dir):
    """transformers' own implementation of the demo checkpoint (fp32): the independent reference."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log-softmax of transformers' logits at every position of ``ids`` -> [len(ids), V]."""
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def test_n_greedy_gives_n_equal_choices(client):
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, n=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert len({c.message.content for c in r.choices}) == 1 and r.choices[0].message.content
    assert r.usage.completion_tokens == 4 * 8  # the prompt is counted once
    one = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, **GREEDY)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    assert r.choices[0].message.content == one.choices[0].message.content


def test_n_prefills_the_prompt_once(stack, client, tokenizer):
    """Choices 1..n-1 take the prompt's K/V from the engine's prefix cache (its whole KV blocks of 16 tokens
    but the one with its last token, which each computes for its own logits) instead of prefilling it again."""
    prompt = "A prompt seen by no other test, long enough to be worth sharing between the choices: " * 3
    before = httpx.get(stack[0].url + "/engine/v1/stats", timeout=10).json()["prefix_cache"]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, n=4, **GREEDY)
    after = httpx.get(stack[0].url + "/engine/v1/stats", timeout=10).json()["prefix_cache"]
    n_prompt = len(tokenizer.encode(prompt))
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4 * n_prompt
    assert after["cached_tokens"] - before["cached_tokens"] == 3 * ((n_prompt - 1) // BLOCK_SIZE * BLOCK_SIZE) > 0
    assert len({c.text for c in r.choices}) == 1


def test_n_sampled_gives_different_choices_reproducibly(client):
    def draw():
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=4, temperature=1.0, seed=5,
                                      extra_body={"ignore_eos": True})
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = draw()
    assert len(set(first)) > 1, first
    assert draw() == first  # seeded: choice i draws with seed + i


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_n_streamed_interleaves_indexed_choices(client, endpoint):
    kw = dict(model=MODEL, max_tokens=6, n=3, temperature=1.0, seed=9, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts = {0: "", 1: "", 2: ""}
    finishes = {}
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=MESSAGES, **kw))
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.delta.content or ""
                finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
        whole = client.chat.completions.create(**{**kw, "stream": False, "stream_options": None}, messages=MESSAGES)
        expected = {c.index: c.message.content for c in whole.choices}
    else:
        chunks = list(client.completions.create(prompt=PROMPT, **kw))
        for c in chunks:
            for ch in c.choices:
                texts[ch.index] += ch.text
                finishes[ch.index] = ch.finish_reason or finishes.get(ch.index)
        whole = client.completions.create(**{**kw, "stream": False, "stream_options": None}, prompt=PROMPT)
        expected = {c.index: c.text for c in whole.choices}
    assert texts == expected  # seeded: streamed and not, the same three choices
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].usage.completion_tokens == 18


def test_completion_logprobs_match_transformers(client, tokenizer, hf_model):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, logprobs=5, **GREEDY)
    lp = r.choices[0].logprobs
    ids = tokenizer.encode(PROMPT)
    for i in range(6):  # transformers' greedy continuation, one position at a time
        step = _hf_logprobs(hf_model, ids)[-1]
        best = int(step.argmax())
        assert lp.token_logprobs[i] == pytest.approx(step[best].item(), abs=1e-4)
        assert lp.tokens[i] == tokenizer.decode([best])
        top_ids = step.topk(5).indices.tolist()
        assert list(lp.top_logprobs[i].values()) == pytest.approx(step[top_ids].tolist(), abs=1e-4)
        ids.append(best)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_streamed_and_not_match_transformers(client, tokenizer, hf_model):
    kw = dict(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    streamed = [e for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    for entry in content:
        step = _hf_logprobs(hf_model, ids)[-1]
        best = int(step.argmax())
        assert entry.token == tokenizer.decode([best]) and entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(step[best].item(), abs=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(step.topk(3).values.tolist(), abs=1e-4)
        ids.append(best)


def test_logit_bias_forces_and_forbids_tokens(client, tokenizer):
    forced = tokenizer.encode(" sea")[0]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, logit_bias={str(forced): 100}, **GREEDY)
    assert r.choices[0].text == tokenizer.decode([forced] * 5)
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=0, **GREEDY)
    first = tokenizer.encode(base.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, logit_bias={str(first): -100},
                                       **GREEDY)
    assert banned.choices[0].text != base.choices[0].text
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.0, seed=3,
                                        logit_bias={str(forced): 100}, extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == tokenizer.decode([forced] * 4)


def test_min_tokens_holds_back_the_end_of_sequence(client, tokenizer):
    eos = tokenizer.eos_token_ids[0]
    bias = {str(eos): 100}  # the model wants to stop at once
    quick = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias)
    assert quick.choices[0].finish_reason == "stop" and quick.usage.completion_tokens == 1
    held = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logit_bias=bias,
                                     extra_body={"min_tokens": 4})
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 5  # 4 tokens, then EOS


def test_min_p_one_samples_the_best_token(client):
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, **GREEDY).choices[0].text
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.5, seed=1,
                                        extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text
    free = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=1.5, seed=1,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert sampled == greedy != free


def _engine_generate(engine, prompt_ids: list[int], sampling: dict) -> tuple[list[int], list[dict]]:
    body = {"request_id": f"t-{id(sampling)}", "prompt_token_ids": prompt_ids, "sampling": sampling}
    with httpx.stream("POST", engine.url + "/engine/v1/generate", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [json.loads(line) for line in r.iter_lines() if line]
    return [t for x in lines for t in x["token_ids"]], [e for x in lines for e in x.get("logprobs", [])]


@pytest.mark.parametrize("name,value", [("frequency_penalty", 2.0), ("presence_penalty", 2.0),
                                        ("frequency_penalty", -2.0)])
def test_penalties_pick_the_best_penalised_token(stack, client, tokenizer, name, value):
    """Greedy under a penalty: each token is the argmax of (the model's logprob - the penalty's term) over
    the 20 best alternatives of the model's own logprobs, counting the tokens generated before it (the
    engine's API: token ids, which text cannot always tell apart); and the openai client sees it too."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, **GREEDY)
    plain = client.completions.create(**kw).choices[0].text
    penalised_text = client.completions.create(**kw, **{name: value}).choices[0].text
    assert penalised_text != plain  # the penalty changed the output
    sampling = {"max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 20, name: value}
    tokens, logprobs = _engine_generate(stack[0], tokenizer.encode(PROMPT), sampling)
    assert tokenizer.decode(tokens, skip_special_tokens=True) == penalised_text
    for i, (chosen, entry) in enumerate(zip(tokens, logprobs)):
        def penalised(token: int, logprob: float) -> float:
            count = tokens[:i].count(token)
            return logprob - (value * count if name == "frequency_penalty" else value * (count > 0))

        best = max(penalised(t, x) for t, x in entry["top"])
        assert penalised(chosen, entry["logprob"]) >= best - 1e-4, (i, chosen, entry)


def test_repetition_penalty_changes_greedy_output_and_stays_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, **GREEDY)
    plain = client.completions.create(**kw).choices[0].text
    kw["extra_body"] = {"ignore_eos": True, "repetition_penalty": 1.5}
    a = client.completions.create(**kw).choices[0].text
    assert a != plain and client.completions.create(**kw).choices[0].text == a


def test_seeded_sampling_with_every_control_is_reproducible(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, seed=42, frequency_penalty=0.5,
              presence_penalty=0.3, logit_bias={"7": 2.0},
              extra_body={"ignore_eos": True, "min_p": 0.05, "repetition_penalty": 1.1, "top_k": 40})
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


@pytest.mark.parametrize("body,param", [({"logit_bias": {"abc": 1}}, "logit_bias"),
                                        ({"logit_bias": {"999999": 1}}, "logit_bias"),
                                        ({"logit_bias": {"5": 500}}, "logit_bias"),
                                        ({"top_logprobs": 2}, "top_logprobs"),
                                        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                                        ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
                                        ({"frequency_penalty": 3}, "frequency_penalty")])
def test_bad_sampling_values_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=body)
    assert err.value.body["param"] == param, err.value.body

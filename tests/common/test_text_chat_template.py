"""render_chat (services/common/chat_template.py) against transformers' apply_chat_template."""

from __future__ import annotations

import json

import pytest

from services.common.chat_template import ChatTemplateError, render_chat
from services.engine.models.demo import write_tokenizer_files

SYSTEM = {"role": "system", "content": "You are terse. Use <b>tags</b> & \"quotes\"."}
CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hi!"}],
    "system": [SYSTEM, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        SYSTEM,
        {"role": "user", "content": "Bonjour, ça va ? 中文 😀"},
        {"role": "assistant", "content": "Oui."},
        {"role": "user", "content": "Et toi ?"},
    ],
    "ends_with_assistant": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "none_fields": [{"role": "user", "content": "x", "name": None},
                    {"role": "assistant", "content": "y", "tool_calls": None}],
    "tool_calls": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "sunny"},
    ],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather <now> & later",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]

# A template that uses the other features of transformers' environment.
FEATURE_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}[{{ ns.n }}:{{ m.role }}] {{ m.content | tojson }}"
    "{% generation %}{{ eos_token }}{% endgeneration %}\n"
    "{% endfor %}{% if extra_flag is defined %}flag={{ extra_flag }}{% endif %}"
    "{% if add_generation_prompt %}>>{% endif %}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


@pytest.fixture(scope="module")
def config(tok_dir):
    return json.loads((tok_dir / "tokenizer_config.json").read_text())


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("gen", [True, False])
def test_matches_transformers(hf, config, name, gen):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert render_chat(config, messages, add_generation_prompt=gen) == expected


@pytest.mark.parametrize("name", ["single", "system", "tool_calls"])
def test_matches_transformers_with_tools(hf, config, name):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    got = render_chat(config, messages, tools=TOOLS)
    assert got == expected
    assert '"description": "Weather <now> & later"' in got  # tojson does not HTML-escape


def test_chatml_shape(config):
    text = render_chat(config, CONVERSATIONS["multi_turn"])
    assert text.startswith("<|im_start|>system\nYou are terse.")
    assert text.endswith("<|im_start|>user\nEt toi ?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("gen", [True, False])
def test_feature_template_matches_transformers(hf, config, gen):
    cfg = {**config, "chat_template": FEATURE_TEMPLATE}
    messages = CONVERSATIONS["multi_turn"]
    expected = hf.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tokenize=False,
                                      add_generation_prompt=gen, extra_flag="on")
    assert render_chat(cfg, messages, add_generation_prompt=gen, extra_flag="on") == expected
    assert expected.startswith("<|endoftext|>[1:user]")


def test_no_template_is_a_clear_error(config):
    cfg = {k: v for k, v in config.items() if k != "chat_template"}
    with pytest.raises(ValueError, match="no chat_template"):
        render_chat(cfg, CONVERSATIONS["single"])


def test_template_raise_is_a_clear_error(config):
    with pytest.raises(ChatTemplateError, match="Unsupported message role: robot"):
        render_chat(config, [{"role": "robot", "content": "beep"}])


def test_invalid_jinja_is_a_clear_error(config):
    with pytest.raises(ValueError, match="not valid Jinja"):
        render_chat({**config, "chat_template": "{% for m in messages %}"}, CONVERSATIONS["single"])


def test_empty_conversation_is_an_error(config):
    with pytest.raises(ValueError, match="empty conversation"):
        render_chat(config, [])


def test_sandbox_blocks_escapes(config):
    evil = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError):
        render_chat({**config, "chat_template": evil}, CONVERSATIONS["single"])


@pytest.mark.parametrize("name", ["system", "multi_turn", "tool_calls"])
def test_tokenizer_apply_chat_template_ids(hf, tok_dir, name):
    from services.common.tokenizer import Tokenizer

    ours = Tokenizer.from_dir(tok_dir).apply_chat_template(CONVERSATIONS[name], add_generation_prompt=True)
    theirs = hf.apply_chat_template(CONVERSATIONS[name], tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours == list(theirs)

"""A tiny harmony (gpt-oss) model for the gateway's tests: the demo BPE plus harmony's marker tokens, a
harmony chat template, and a tiny random ``GptOssForCausalLM`` checkpoint written by transformers.

The template is written here after the harmony format, reading messages the way the published gpt-oss
template does (a leading system/developer message as the developer's instructions, the tools in a
``functions`` namespace, the first of an assistant message's tool_calls as ``to=functions.NAME``
commentary ending in ``<|call|>``, a tool result named after the last call, reasoning under
``thinking``, a ``reasoning_effort`` variable defaulting to medium); the published template is not
copied into the repository.
"""

from __future__ import annotations

import json
from pathlib import Path

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]

HARMONY_TEMPLATE = r"""
{%- macro system_message() -%}
    {%- if reasoning_effort is not defined -%}
        {%- set reasoning_effort = "medium" -%}
    {%- endif -%}
    {{- "<|start|>system<|message|>You are a tiny test model.\nReasoning: " + reasoning_effort + "\n\n" -}}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." -}}
    {%- if tools -%}
        {{- "\nCalls to these tools must go to the commentary channel: 'functions'." -}}
    {%- endif -%}
    {{- "<|end|>" -}}
{%- endmacro -%}
{{- system_message() -}}
{%- if messages[0].role in ["system", "developer"] -%}
    {%- set instructions = messages[0].content -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set instructions = "" -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if instructions or tools -%}
    {{- "<|start|>developer<|message|>" -}}
    {%- if instructions -%}
        {{- "# Instructions\n\n" + instructions + "\n\n" -}}
    {%- endif -%}
    {%- if tools -%}
        {{- "# Tools\n\n## functions\n\nnamespace functions {\n\n" -}}
        {%- for tool in tools -%}
            {{- "// " + (tool.function.description or "") + "\ntype " + tool.function.name + " = (_: " -}}
            {{- (tool.function.parameters or {}) | tojson + ") => any;\n\n" -}}
        {%- endfor -%}
        {{- "} // namespace functions" -}}
    {%- endif -%}
    {{- "<|end|>" -}}
{%- endif -%}
{%- set last = namespace(call=none) -%}
{%- for message in turns -%}
    {%- if message.role == "user" -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" -}}
    {%- elif message.role == "assistant" and message.tool_calls -%}
        {%- set call = message.tool_calls[0] -%}
        {%- if call.function -%}
            {%- set call = call.function -%}
        {%- endif -%}
        {%- if message.thinking -%}
            {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" -}}
        {%- endif -%}
        {{- "<|start|>assistant to=functions." + call.name + "<|channel|>commentary json<|message|>" -}}
        {{- call.arguments | tojson + "<|call|>" -}}
        {%- set last.call = call.name -%}
    {%- elif message.role == "assistant" -%}
        {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" -}}
        {%- set last.call = none -%}
    {%- elif message.role == "tool" -%}
        {%- if last.call is none -%}
            {{- raise_exception("a tool message needs an earlier assistant tool call") -}}
        {%- endif -%}
        {{- "<|start|>functions." + last.call + " to=assistant<|channel|>commentary<|message|>" -}}
        {{- message.content | tojson + "<|end|>" -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- "<|start|>assistant" -}}
{%- endif -%}
"""


def harmony_tokenizer_json() -> str:
    """The demo BPE with the harmony markers as special tokens (ids 674-680)."""
    from tokenizers import AddedToken, Tokenizer

    from services.engine.models.demo import _tokenizer_json

    tok = Tokenizer.from_str(_tokenizer_json())
    tok.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return tok.to_str()


def write_harmony_tokenizer(d: Path) -> dict[str, int]:
    """tokenizer.json, tokenizer_config.json and generation_config.json of a harmony model into ``d``;
    returns the marker ids. EOS as gpt-oss's generation_config has it: <|return|>, <|endoftext|>, <|call|>."""
    from tokenizers import Tokenizer

    d.mkdir(parents=True, exist_ok=True)
    text = harmony_tokenizer_json()
    (d / "tokenizer.json").write_text(text)
    tok = Tokenizer.from_str(text)
    ids = {m: tok.token_to_id(m) for m in [*MARKERS, "<|endoftext|>"]}
    (d / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(ids[m]): {"content": m, "lstrip": False, "normalized": False, "rstrip": False,
                                               "single_word": False, "special": True} for m in ids},
        "bos_token": "<|endoftext|>", "eos_token": "<|return|>",
        "pad_token": "<|endoftext|>", "chat_template": HARMONY_TEMPLATE, "model_max_length": 4096,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}, indent=2))
    (d / "generation_config.json").write_text(json.dumps({
        "bos_token_id": ids["<|endoftext|>"], "do_sample": True, "pad_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|return|>"], ids["<|endoftext|>"], ids["<|call|>"]]}, indent=2))
    return ids


def write_tiny_gpt_oss(d: Path) -> Path:
    """A tiny random gpt-oss checkpoint (transformers' own class and save_pretrained) with the harmony
    tokenizer, in ``d``."""
    import torch
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=768, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                       sliding_window=8, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    GptOssForCausalLM(cfg).save_pretrained(d)
    write_harmony_tokenizer(d)
    return d

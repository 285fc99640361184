"""What Tandem does with every field of the OpenAI chat and completions requests: each one is either
honoured or refused with a 400 naming it; nothing is silently ignored.

The request models (protocol.py) declare every field of OpenAI's API plus Tandem's extensions and
refuse any other field (an unknown field is a 400 too). This table is the single place that says what
happens to each declared field; ``refuse_unsupported`` enforces it before a request reaches an engine.
A refused field is still accepted at its neutral value (the default that clients send without being
asked, e.g. ``logit_bias: {}``). docs/openai-api.md shows the same table to users, and
tests/gateway/test_request_fields.py checks the three (models, this table, docs) agree and that each
field behaves as listed against a real server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HONOURED = "honoured"
REFUSED = "refused"


@dataclass(frozen=True)
class FieldRule:
    support: str  # HONOURED or REFUSED
    note: str  # what Tandem does (honoured) or why not (refused): the user reads it in docs and errors
    neutral: tuple = (None,)  # values of a refused field that are accepted (they ask for nothing)


def _honoured(note: str) -> FieldRule:
    return FieldRule(HONOURED, note)


def _refused(note: str, *neutral: Any) -> FieldRule:
    return FieldRule(REFUSED, note, (None, *neutral))


_SHARED = {
    "model": _honoured("a model name the engines serve (GET /v1/models)"),
    "frequency_penalty": _honoured("minus the penalty times the token's count in the output, on the logits"),
    "logit_bias": _honoured("token id -> bias in [-100, 100] added to its logit (greedy requests too)"),
    "n": _honoured("n choices; the prompt is prefilled once, the others share its KV blocks through the prefix cache "
                   "(unless the engine runs --no-prefix-cache or --batch-invariant); with a seed, choice i uses seed + i"),
    "presence_penalty": _honoured("minus the penalty for every token already in the output, on the logits"),
    "seed": _honoured("seeds the request's own generator: the same seed gives the same tokens in any batch"),
    "stop": _honoured("up to 4 strings; the text ends before the first match (finish_reason \"stop\")"),
    "stream": _honoured("Server-Sent Events chunks ending with `data: [DONE]`"),
    "stream_options": _honoured("`include_usage` adds a final usage chunk"),
    "temperature": _honoured("0 is greedy; default from the model's generation_config"),
    "top_p": _honoured("nucleus sampling; default from the model's generation_config"),
    "user": _honoured("accepted as information only (OpenAI uses it for abuse monitoring; it changes no output)"),
    # -- Tandem extensions (vLLM's names; clients send them as extra_body) ---------------------------
    "top_k": _honoured("extension: keep the k most likely tokens (-1 or 0: all)"),
    "min_p": _honoured("extension: drop tokens below min_p x the best one's probability (after temperature)"),
    "repetition_penalty": _honoured("extension: logits of prompt and output tokens / the penalty (x when "
                                    "negative); default from generation_config"),
    "min_tokens": _honoured("extension: EOS and stop token ids are banned before this many tokens "
                            "(stop strings still apply)"),
    "ignore_eos": _honoured("extension: keep generating past the end-of-sequence token (benchmarks)"),
}

CHAT_FIELDS: dict[str, FieldRule] = {
    "messages": _honoured("rendered with the model's chat template; text content parts only (others: 400)"),
    **_SHARED,
    "audio": _refused("audio output is not supported (text models only)"),
    "function_call": _refused("deprecated by OpenAI: send tool_choice", "none"),
    "functions": _refused("deprecated by OpenAI: send tools", []),
    "logprobs": _honoured("the model's log-probabilities of the sampled tokens (before penalties, biases and "
                          "temperature)"),
    "max_completion_tokens": _honoured("the completion's token limit (400 when prompt + it exceed the context)"),
    "max_tokens": _honoured("deprecated alias of max_completion_tokens"),
    "metadata": _honoured("accepted as information only (tags a stored completion at OpenAI; nothing is stored)"),
    "modalities": _refused("only text output is supported", ["text"]),
    "moderation": _refused("moderation is not supported"),
    "parallel_tool_calls": _honoured("false: at most one tool call per answer (default true)"),
    "prediction": _refused("predicted outputs are not supported"),
    "prompt_cache_key": _honoured("accepted as a hint only (Tandem has no prompt cache to route by)"),
    "prompt_cache_options": _refused("prompt caching options are not supported"),
    "prompt_cache_retention": _refused("prompt cache retention is not supported"),
    "reasoning_effort": _honoured("low, medium or high, given to the chat template as its reasoning_effort "
                                  "(gpt-oss); a model whose template has no such variable refuses it (400)"),
    "response_format": _honoured("json_object / json_schema: the output is valid JSON (under the schema) by "
                                 "constrained decoding; a schema that does not compile is a 400"),
    "safety_identifier": _honoured("accepted as information only (OpenAI uses it for abuse monitoring)"),
    "service_tier": _refused("service tiers are not supported", "auto", "default"),
    "store": _refused("completions are never stored", False),
    "tool_choice": _honoured("none, auto (parsed from the model's own tool-call syntax), required or a named "
                             "function (forced by constrained decoding)"),
    "tools": _honoured("function tools, rendered by the chat template; calls come back as tool_calls"),
    "top_logprobs": _honoured("0-20 most likely alternatives per token (needs logprobs: true)"),
    "verbosity": _refused("verbosity is not supported"),
    "web_search_options": _refused("web search is not supported"),
    "chat_template_kwargs": _honoured("extension: extra variables for the chat template (e.g. enable_thinking)"),
}

COMPLETION_FIELDS: dict[str, FieldRule] = {
    "prompt": _honoured("a string or token ids; one prompt per request (several: 400)"),
    **_SHARED,
    "best_of": _refused("best_of > 1 is not supported", 1),
    "echo": _refused("echo is not supported", False),
    "logprobs": _honoured("0-20: the sampled token's logprob and this many alternatives (the model's own "
                          "distribution)"),
    "max_tokens": _honoured("the completion's token limit, default 16 (400 when prompt + it exceed the context)"),
    "suffix": _refused("suffix (fill-in-the-middle) is not supported", ""),
}


ANTHROPIC_FIELDS: dict[str, FieldRule] = {  # POST /v1/messages (serving_anthropic.py)
    "model": _honoured("a model name the engines serve (GET /v1/models)"),
    "messages": _honoured("user/assistant turns rendered with the model's chat template; text blocks only "
                          "(others: 400)"),
    "max_tokens": _honoured("the completion's token limit (400 when prompt + it exceed the context)"),
    "cache_control": _honoured("accepted as a hint only: the engine's prefix cache reuses any repeated prefix "
                               "by itself (usage.cache_read_input_tokens)"),
    "container": _refused("code-execution containers are not supported"),
    "diagnostics": _refused("diagnostics are not supported"),
    "inference_geo": _refused("inference geography is not supported"),
    "metadata": _honoured("accepted as information only (user_id; changes no output)"),
    "output_config": _refused("output configuration (effort, structured output) is not served yet"),
    "service_tier": _refused("service tiers are not supported", "auto", "standard_only"),
    "speed": _refused("speed modes are not supported"),
    "stop_sequences": _honoured("up to 4 strings; stop_reason \"stop_sequence\" names the one that matched"),
    "stream": _honoured("Anthropic's named SSE events (message_start ... message_stop)"),
    "system": _honoured("rendered as the chat template's system message (a string or text blocks)"),
    "temperature": _honoured("0 is greedy, up to 1; default from the model's generation_config"),
    "thinking": _refused("extended thinking is not supported; models that can think take "
                         "the OpenAI endpoint's chat_template_kwargs", {"type": "disabled"}),
    "tool_choice": _honoured("auto, any (a call is forced), tool (that tool is forced) or none; "
                             "disable_parallel_tool_use: at most one call"),
    "tools": _honoured("client tools (input_schema), rendered by the chat template; calls come back as tool_use "
                       "blocks (stop_reason \"tool_use\")"),
    "top_k": _honoured("keep the k most likely tokens (0: all)"),
    "top_p": _honoured("nucleus sampling; default from the model's generation_config"),
    "user_profile_id": _refused("user profiles are not supported"),
    "workspace_id": _refused("workspaces are not supported"),
}


def table_for(req) -> dict[str, FieldRule]:
    return CHAT_FIELDS if hasattr(req, "messages") else COMPLETION_FIELDS


def refuse_unsupported(req) -> None:
    """Raise RequestError (400, param = the field) for the first field set to a value Tandem refuses."""
    refuse_fields(req, table_for(req))


def refuse_fields(req, table: dict[str, FieldRule]) -> None:
    from services.gateway.generation import RequestError

    for name in type(req).model_fields:
        rule = table[name]
        value = getattr(req, name)
        if rule.support == REFUSED and name in req.model_fields_set and not _is_neutral(value, rule.neutral):
            raise RequestError(f"{name} is not supported: {rule.note} (docs/openai-api.md lists every field)", name)


def _is_neutral(value: Any, neutral: tuple) -> bool:
    """value is one of ``neutral`` (True is not 1, False is not 0: a boolean asks for something else)."""
    return any(value == n and isinstance(value, bool) == isinstance(n, bool) for n in neutral)

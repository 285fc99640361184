"""Chat templates rendered the way transformers' ``apply_chat_template`` renders them (torch-free).

Same Jinja environment as transformers (``utils/chat_template_utils.py``): an
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension and a ``{% generation %}`` tag, globals ``raise_exception``, ``strftime_now``, ``dict``
and ``namespace``, and a ``tojson`` filter that does not HTML-escape. The template sees the named
special tokens of tokenizer_config (``bos_token``, ``eos_token``, ...), ``messages`` (keys whose
value is None dropped, as transformers does), ``tools``, ``documents``, ``add_generation_prompt``
and any extra keyword (e.g. ``enable_thinking``). Templates are untrusted code from the Hub: the
sandbox is what makes rendering them safe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Named special tokens transformers passes to every template (SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning may come under; templates read the first (transformers aliases them).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """The chat template is missing, is not valid Jinja, or raised while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson HTML-escapes (<, >, &, '): chat templates need the plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates without exposing the dict type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore attributes (no reach into CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables ``template`` reads from its caller (e.g. gpt-oss's ``reasoning_effort``; a variable
    it only reads under ``is defined`` counts); ChatTemplateError when it is not valid Jinja."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat_template of tokenizer_config.json is not valid Jinja "
                                f"(line {err.lineno}): {err.message}") from err


def _plain(value: Any) -> Any:
    """Plain JSON-like data for the sandbox (pydantic models dumped, subclasses of str/int reduced)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value] if isinstance(value, list) else tuple(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Sequence[Any]) -> list[dict]:
    """Messages as dicts without None values (OpenAI clients send content=None / tool_calls=None,
    which many templates would print as "None"), reasoning aliased under all its names."""
    out = []
    for i, message in enumerate(messages):
        if callable(getattr(message, "model_dump", None)):
            message = message.model_dump()
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, expected a dict with 'role'")
        message = {k: v for k, v in _plain(dict(message)).items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def select_template(tokenizer_config: Mapping[str, Any], tools: Sequence[Any] | None = None) -> str:
    """The template string of tokenizer_config: a single template, or among named ones ("tool_use"
    when tools are given and it exists, else "default")."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # the older list form [{"name": ..., "template": ...}]
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
    if isinstance(template, Mapping):
        if tools is not None and template.get("tool_use"):
            template = template["tool_use"]
        elif template.get("default"):
            template = template["default"]
        else:
            raise ChatTemplateError(f"tokenizer_config.json has several chat templates ({sorted(template)}) "
                                    "and none named 'default'")
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("tokenizer_config.json has no chat_template: this model cannot render chat "
                                "messages (use /v1/completions with a plain prompt)")
    return template


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings (AddedToken dicts reduced to their content); unset ones left out."""
    out = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = tokenizer_config.get(name)
        if isinstance(value, Mapping):
            value = value.get("content")
        if value is not None:
            out[name] = str(value)
    return out


def render_chat(tokenizer_config: Mapping[str, Any], messages: Sequence[Any], add_generation_prompt: bool = True,
                tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None, **extra: Any) -> str:
    """Render ``messages`` (OpenAI-style dicts: role, content, optional tool_calls, ...) with the
    chat template of ``tokenizer_config``; the same string as transformers'
    ``apply_chat_template(messages, tokenize=False, add_generation_prompt=..., tools=..., **extra)``.

    Raises ChatTemplateError (a ValueError) naming the problem: no template, invalid Jinja, an
    empty conversation, or an error the template raised (e.g. an unsupported role).
    """
    if not messages:
        raise ChatTemplateError("cannot apply the chat template to an empty conversation")
    template = select_template(tokenizer_config, tools)
    try:
        compiled = _compile(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(f"chat_template of tokenizer_config.json is not valid Jinja "
                                f"(line {err.lineno}): {err.message}") from err
    tool_schemas = None
    if tools is not None:
        tool_schemas = []
        for tool in tools:
            tool = _plain(tool)
            if not isinstance(tool, dict):
                raise ChatTemplateError(f"tools must be JSON schemas (dicts), got {type(tool).__name__}")
            tool_schemas.append(tool)
    variables = {**special_tokens(tokenizer_config), **_plain(extra)}  # extra overrides the special tokens
    try:
        return compiled.render(messages=_normalize_messages(messages), tools=tool_schemas,
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                               **variables)
    except ChatTemplateError:
        raise
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"chat template error: {err.message or err}") from err
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
        raise ChatTemplateError(f"chat template failed on these messages: {type(err).__name__}: {err}") from err

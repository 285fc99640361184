"""POST /tokenize and POST /detokenize in vLLM's shapes (the model's own tokenizer, no generation).

    /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                 or {model?, messages, add_generation_prompt=true, add_special_tokens=false,
                 chat_template_kwargs?, return_token_strs=false}   (the chat rendered with its template)
                 -> {"count", "max_model_len", "tokens", "token_strs"}
    /detokenize  {model?, tokens} -> {"prompt"}

``model`` may be left out when the gateway serves a single model. Unknown fields are a 400 naming them.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from services.common.chat_template import ChatTemplateError, render_chat
from services.gateway.engines import EnginePool, EngineState
from services.gateway.generation import RequestError
from services.gateway.protocol import ChatMessage, TopLevelRequest
from services.gateway.serving_chat import template_kwargs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TokenizeRequest(TopLevelRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def _engine(pool: EnginePool, model: str | None) -> EngineState:
    if model is None:
        models = {e.model_id for e in pool.models().values()}  # aliases of one model count once
        if len(models) != 1:
            raise RequestError(f"model is required: this gateway serves {', '.join(pool.models()) or 'no model yet'}",
                               "model")
        model = models.pop()
    return pool.pick(model)


def tokenize(pool: EnginePool, req: TokenizeRequest) -> dict:
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give either prompt or messages", "prompt")
    engine = _engine(pool, req.model)
    if req.messages is not None:
        for i, m in enumerate(req.messages):
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                raise RequestError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        try:
            kwargs = template_kwargs(req.chat_template_kwargs, open_to=frozenset({"tools", "documents"}))
            text = render_chat(engine.info.get("tokenizer_config") or {}, messages,
                               add_generation_prompt=req.add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), "messages") from exc
        special = bool(req.add_special_tokens)
    else:
        text = req.prompt
        special = req.add_special_tokens is not False
    ids = engine.tokenizer.encode(text, add_special_tokens=special)
    strs = [engine.tokenizer.backend.id_to_token(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": engine.info.get("max_seq_len"), "tokens": ids, "token_strs": strs}


def detokenize(pool: EnginePool, req: DetokenizeRequest) -> dict:
    engine = _engine(pool, req.model)
    vocab = engine.tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"tokens outside the vocabulary [0, {vocab}): {bad[:5]}", "tokens")
    return {"prompt": engine.tokenizer.decode(req.tokens)}

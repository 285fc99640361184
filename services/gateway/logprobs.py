"""Logprobs in OpenAI's two shapes, from the engine's entries {"token_id", "logprob", "top": [[id, lp]]}.

The values are the model's own distribution (log-softmax of its logits, before penalties, biases and
temperature: vLLM's default). A token's text is its own decoding; a token that holds part of a UTF-8
character reads U+FFFD there, and its ``bytes`` are those of that text (OpenAI gives the raw bytes).
"""

from __future__ import annotations

from services.common.tokenizer import Tokenizer


def _token(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(entries: list[dict], tokenizer: Tokenizer) -> dict:
    """choices[].logprobs of chat: {"content": [{"token", "logprob", "bytes", "top_logprobs"}], "refusal"}."""
    def item(token_id: int, logprob: float) -> dict:
        text = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = [{**item(e["token_id"], e["logprob"]), "top_logprobs": [item(t, lp) for t, lp in e["top"]]}
               for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: list[dict], tokenizer: Tokenizer, text_offset: int = 0) -> dict:
    """choices[].logprobs of completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"};
    ``text_offset`` is where the first token's text starts in the choice's text so far (streaming)."""
    tokens = [_token(tokenizer, e["token_id"]) for e in entries]
    offsets = []
    for t in tokens:
        offsets.append(text_offset)
        text_offset += len(t)
    return {"tokens": tokens, "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{_token(tokenizer, t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets}

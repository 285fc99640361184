"""Harmony (gpt-oss) replies: the analysis channel comes back as reasoning_content, apart from the answer,
whatever the engine's deltas cut the token stream into; a tokenizer without the markers splits nothing."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.common.tokenizer import Tokenizer
from services.engine.models.demo import write_tokenizer_files
from services.gateway import generation as g
from services.gateway.reasoning import harmony_splitter

MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>"]
REPLY = ("<|channel|>analysis<|message|>The user greets; answer briefly.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there!")


def _tokenizer(d: Path, harmony: bool) -> Tokenizer:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    write_tokenizer_files(d)
    backend = HFTokenizer.from_file(str(d / "tokenizer.json"))
    if harmony:
        backend.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    return Tokenizer(backend, {}, {})


@pytest.fixture(scope="module")
def harmony(tmp_path_factory) -> Tokenizer:
    return _tokenizer(tmp_path_factory.mktemp("harmony"), harmony=True)


def _split(tok: Tokenizer, ids: list[int], cut: int) -> tuple[str, str]:
    splitter = harmony_splitter(tok)
    reasoning, answer = [], []
    for part in (ids[:cut], ids[cut:]):
        parts = splitter.feed(part)
        reasoning += parts.reasoning
        answer += parts.answer
    return tok.decode(reasoning, skip_special_tokens=True), tok.decode(answer, skip_special_tokens=True)


def test_splits_at_every_cut(harmony):
    ids = harmony.encode(REPLY)
    assert harmony.token_to_id("<|channel|>") in ids
    for cut in range(len(ids) + 1):
        assert _split(harmony, ids, cut) == ("The user greets; answer briefly.", "Hello there!")


def test_no_markers_no_splitter(tmp_path):
    assert harmony_splitter(_tokenizer(tmp_path, harmony=False)) is None


class _Client:
    id = "engine-0"

    async def abort(self, request_id, reason):
        raise AssertionError("nothing to abort here")


class _Engine:
    """The gateway's view of an engine that streams the reply (the generation's logic is under test)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.client, self.outstanding = tokenizer, _Client(), 1


async def _stream(chunks, stop_id):
    for i, ids in enumerate(chunks):
        last = i == len(chunks) - 1
        yield {"token_ids": ids, **({"finish_reason": "stop", "stop_token_id": stop_id} if last else {})}


def test_deltas_carry_reasoning_apart_from_the_text(harmony):
    stop = harmony.token_to_id("<|return|>")
    ids = harmony.encode(REPLY) + [stop]
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    gen = g.Generation(_Engine(harmony), [1, 2], {}, [])

    async def run():
        return [d async for d in g.deltas(gen, _stream(chunks, stop))]

    out = asyncio.run(run())
    assert "".join(d.reasoning for d in out) == gen.reasoning == "The user greets; answer briefly."
    assert "".join(d.text for d in out) == gen.text == "Hello there!"
    assert out[-1].finish_reason == "stop"


def test_reasoning_sent_back_reaches_the_template_as_thinking():
    """gpt-oss's template reads an assistant message's ``thinking``; clients send ``reasoning_content``."""
    from services.common.chat_template import render_chat
    from services.gateway.protocol import ChatCompletionRequest
    from services.gateway.serving_chat import _messages

    req = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet back."},
        {"role": "user", "content": "bye"}])
    template = "{% for m in messages %}[{{ m.role }}|{{ m.thinking or '' }}|{{ m.content }}]{% endfor %}"
    assert render_chat({"chat_template": template}, _messages(req)) == "[user||hi][assistant|Greet back.|Hello!][user||bye]"

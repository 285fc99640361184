"""Constrained decoding in the engine (services/engine/runtime/grammar.py): on the demo model's random
weights, sampled output must still match its grammar, because the mask leaves no other choice. The
JSON checks use the `jsonschema` package, independent of the grammar library."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from services.common.tokenizer import Tokenizer
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models.demo import write_demo_checkpoint
from services.engine.runtime.grammar import GrammarCompiler, GrammarError, TokenMasks
from services.engine.runtime.sampler import SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit", "rain"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "days": {"type": "integer", "minimum": 1, "maximum": 14},
                         "unit": {"enum": ["celsius", "fahrenheit"]},
                         "rain": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "ckpt", seed=0)


@pytest.fixture(scope="module")
def engine(ckpt):
    engine = Engine(EngineConfig(model=str(ckpt), max_seq_len=256, max_running_requests=4))
    engine.start()
    engine.wait_ready(120)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(ckpt) -> Tokenizer:
    return Tokenizer.from_dir(ckpt)


def _generate(engine: Engine, prompt: list[int], requests: list[SamplingParams]) -> list[tuple[list[int], str]]:
    """Run ``requests`` concurrently (one batch) -> (token ids, finish_reason) of each."""
    async def one(i: int, params: SamplingParams):
        ids, finish = [], None
        async for out in engine.submit(f"g{i}-{id(params)}", prompt, params):
            ids += out["token_ids"]
            finish = out["finish_reason"]
        return ids, finish

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(requests)))

    return asyncio.run(main())


def _text(tokenizer: Tokenizer, ids: list[int]) -> str:
    if ids and ids[-1] in tokenizer.eos_token_ids:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def test_json_schema_output_validates_on_random_weights(engine, tokenizer):
    prompt = tokenizer.encode("The weather in the city")
    grammar = {"json_schema": SCHEMA}
    free = SamplingParams(max_tokens=20, temperature=0.0)
    alone = _generate(engine, prompt, [free])[0]
    sampled = [SamplingParams(max_tokens=200, temperature=1.0, seed=s, grammar=grammar) for s in range(3)]
    greedy = SamplingParams(max_tokens=200, temperature=0.0, grammar=grammar)
    results = _generate(engine, prompt, [*sampled, greedy, free])
    for ids, finish in results[:4]:
        assert finish == "stop", (finish, _text(tokenizer, ids))
        jsonschema.validate(json.loads(_text(tokenizer, ids)), SCHEMA)
    assert len({tuple(ids) for ids, _ in results[:3]}) > 1  # the seeds still choose among allowed tokens
    assert results[4] == alone  # a row without a grammar is not touched by its neighbours' masks


def test_json_object_and_lark_grammars(engine, tokenizer):
    prompt = tokenizer.encode("Hello")
    lark = 'start: "<tool_call>\\n" %json {"type": "object", "properties": {"n": {"type": "integer"}}, ' \
           '"required": ["n"], "additionalProperties": false} "\\n</tool_call>"'
    obj = SamplingParams(max_tokens=200, temperature=1.0, seed=3,
                         grammar={"json_schema": {"type": "object", "maxProperties": 2,
                                                  "additionalProperties": {"type": "integer"}}})
    call = SamplingParams(max_tokens=200, temperature=1.0, seed=4, grammar={"lark": lark})
    (obj_ids, obj_finish), (call_ids, call_finish) = _generate(engine, prompt, [obj, call])
    assert obj_finish == "stop" and isinstance(json.loads(_text(tokenizer, obj_ids)), dict)
    m = re.fullmatch(r"<tool_call>\n(.*)\n</tool_call>", _text(tokenizer, call_ids), re.S)
    assert call_finish == "stop" and m and isinstance(json.loads(m.group(1))["n"], int)


def test_grammar_that_does_not_compile_is_refused_with_the_reason(engine, tokenizer):
    async def submit(grammar):
        engine.submit("bad", [1, 2], SamplingParams(max_tokens=4, grammar=grammar))

    with pytest.raises(GrammarError, match="objectx"):
        asyncio.run(submit({"json_schema": {"type": "objectx"}}))
    with pytest.raises(GrammarError, match="unknown name"):
        asyncio.run(submit({"lark": "start: foo"}))
    for bad in ({"regex": "a+"}, {"json_schema": "{}"}, {"lark": 1}, {"json_schema": {}, "lark": "start: 'a'"}):
        with pytest.raises((TypeError, ValueError), match="grammar"):
            SamplingParams.from_dict({"grammar": bad})
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar={"json_schema": {}}, ignore_eos=True)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(grammar={"json_schema": {}}, min_tokens=3)


def test_masks_equal_each_matchers_own_bitmask(ckpt):
    """TokenMasks.apply (batched fill, unpacked on the logits' device) against each matcher's single
    compute_bitmask() unpacked with plain Python; rows without a grammar are left alone."""
    compiler = GrammarCompiler((ckpt / "tokenizer.json").read_text(), 1100, [2])
    matchers = [compiler.compile({"json_schema": SCHEMA}), None, compiler.compile({"lark": 'start: "ab" | "cd"'})]
    assert matchers[0].consume_tokens(Tokenizer.from_dir(ckpt).encode('{"city":"'))
    logits = torch.randn(3, 1100, generator=torch.Generator().manual_seed(0))
    masked = logits.clone()
    TokenMasks(compiler.mask_vocab).apply(masked, matchers)
    assert torch.equal(masked[1], logits[1])
    for row in (0, 2):
        bits = matchers[row].compute_bitmask()
        allowed = [bool(bits[t // 8] >> (t % 8) & 1) for t in range(1100)]
        assert 0 < sum(allowed) < 1100
        for t in range(1100):
            assert masked[row, t].item() == (logits[row, t].item() if allowed[t] else float("-inf"))

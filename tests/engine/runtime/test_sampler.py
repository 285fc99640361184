"""Sampler: greedy/top-k=1 agree, seeds reproduce, filters keep only allowed tokens."""

import pytest
import torch

from services.engine.runtime.sampler import Sampler, SamplingParams, make_generator

V = 257  # odd vocabulary size


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 3  # [N, V]


def _draw(logits, params, seeds):
    gens = [make_generator(s, logits.device) for s in seeds]
    return Sampler()(logits, params, gens)


def test_top_k_1_equals_greedy():
    logits = _logits(9)
    greedy = Sampler()(logits, [SamplingParams(temperature=0.0)] * 9, [None] * 9)
    assert greedy == logits.argmax(-1).tolist()
    topk1 = _draw(logits, [SamplingParams(temperature=1.3, top_k=1)] * 9, range(9))
    assert topk1 == greedy


def test_same_seed_same_tokens_different_seeds_differ():
    logits = _logits(1)
    p = SamplingParams(temperature=1.0)
    gen_a, gen_b, gen_c = (make_generator(s, logits.device) for s in (7, 7, 8))
    a = [Sampler()(logits, [p], [gen_a])[0] for _ in range(32)]
    b = [Sampler()(logits, [p], [gen_b])[0] for _ in range(32)]
    c = [Sampler()(logits, [p], [gen_c])[0] for _ in range(32)]
    assert a == b
    assert a != c
    assert len(set(a)) > 1  # really sampling, not argmax


def test_row_result_independent_of_batch_neighbours():
    logits = _logits(4, seed=3)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=11)] * 4
    alone = _draw(logits[2:3], params[:1], [11])
    batched = _draw(logits, params, [1, 2, 11, 4])
    assert batched[2] == alone[0]
    # neighbours with other filters (a larger top-k, none at all) change nothing either
    mixed = [SamplingParams(temperature=0.8, top_k=200), SamplingParams(temperature=1.0),
             params[0], SamplingParams(temperature=0.0)]
    assert _draw(logits, mixed, [1, 2, 11, 4])[2] == alone[0]


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (-1, 0.3), (20, 0.5)])
def test_filters_only_allow_permitted_tokens(top_k, top_p):
    logits = _logits(1, seed=5) / 6  # soft enough that every filter keeps several tokens
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    allowed = set(order[: top_k if top_k > 0 else V].tolist())
    # nucleus on the top-k-renormalised distribution: smallest prefix whose mass reaches top_p
    kept = probs[order[: top_k if top_k > 0 else V]]
    kept = kept / kept.sum()
    n_nucleus = int((kept.cumsum(0) - kept < top_p).sum())
    allowed &= set(order[:n_nucleus].tolist())
    gen = make_generator(0, logits.device)
    p = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
    seen = {Sampler()(logits, [p], [gen])[0] for _ in range(200)}
    assert seen <= allowed
    assert len(seen) > 1


def test_invalid_params_rejected():
    for kw in ({"temperature": -0.1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_tokens": 0}, {"top_k": -2}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="unknown sampling field"):
        SamplingParams.from_dict({"temprature": 1.0})
    for kw in ({"seed": "7"}, {"max_tokens": 2.5}, {"temperature": "hot"}, {"ignore_eos": 1},
               {"stop_token_ids": [1, "2"]}, {"top_k": True}):
        with pytest.raises(TypeError):
            SamplingParams.from_dict(kw)

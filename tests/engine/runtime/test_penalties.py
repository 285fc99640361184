"""Logit processors (penalties.py), min_p and token logprobs (sampler.py) against plain-Python references
of their definitions (OpenAI's presence/frequency penalties, CTRL's repetition penalty, vLLM's min_p)."""

import math

import pytest
import torch

from services.engine.runtime import penalties
from services.engine.runtime.sampler import Sampler, SamplingParams, make_generator, token_logprobs

V = 11
EOS = 10


def _reference(row: list[float], p: SamplingParams, prompt: list[int], output: list[int]) -> list[float]:
    out = list(row)
    for t, b in p.logit_bias.items():
        out[t] += b
    if len(output) < p.min_tokens:
        for t in [EOS, *p.stop_token_ids]:
            out[t] = -math.inf
    for t in range(V):
        if p.repetition_penalty != 1.0 and (t in prompt or t in output):
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        count = output.count(t)
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


CASES = [SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=-0.7),
         SamplingParams(repetition_penalty=1.3), SamplingParams(repetition_penalty=0.8, frequency_penalty=0.4),
         SamplingParams(logit_bias={"3": 100, 4: -2.5}), SamplingParams(min_tokens=4, stop_token_ids=[2]),
         SamplingParams(presence_penalty=0.3, frequency_penalty=0.6, repetition_penalty=1.1, logit_bias={"0": 1},
                        min_tokens=2)]


@pytest.mark.parametrize("p", CASES)
def test_processors_match_their_definitions(p):
    g = torch.Generator().manual_seed(0)
    prompt, output = [1, 5, 5, 7], [2, 5, 8, 8, 8]
    state = penalties.LogitState.create(prompt, p, V, [EOS], torch.device("cpu"))
    rows = torch.randn(len(output) + 1, V, generator=g) * 3  # [steps, V]
    for step in range(len(output) + 1):
        logits = rows[step:step + 1].clone()
        got = penalties.apply(logits, [p], [state])[0].tolist()
        assert torch.equal(logits, rows[step:step + 1])  # the input (read for logprobs) is left alone
        assert got == pytest.approx(_reference(rows[step].tolist(), p, prompt, output[:step]), abs=1e-5)
        if step < len(output):
            state.record(torch.tensor([output[step]]))


def test_rows_without_processors_are_untouched_and_neighbours_do_not_mix():
    logits = torch.randn(3, V)
    params = [SamplingParams(), SamplingParams(logit_bias={"1": 5}), SamplingParams()]
    states = [None, penalties.LogitState.create([0], params[1], V, [EOS], torch.device("cpu")), None]
    out = penalties.apply(logits, params, states)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    assert out[1, 1] == logits[1, 1] + 5
    assert penalties.apply(logits, [SamplingParams()] * 3, [None] * 3) is logits


def test_logit_bias_forces_a_token_even_when_greedy():
    logits = torch.randn(1, V)
    p = SamplingParams(temperature=0.0, logit_bias={"6": 100})
    state = penalties.LogitState.create([0], p, V, [EOS], torch.device("cpu"))
    assert Sampler()(penalties.apply(logits, [p], [state]), [p], [None]) == [6]


def test_min_p_keeps_only_tokens_near_the_best():
    logits = torch.tensor([[4.0, 3.9, 0.0, -1.0, 2.0]])  # probs ~ .48 .43 .01 .003 .06
    probs = logits.softmax(-1)[0]
    allowed = {i for i in range(5) if probs[i] >= 0.2 * probs.max()}
    assert allowed == {0, 1}
    p = SamplingParams(temperature=1.0, min_p=0.2)
    seen = {Sampler()(logits, [p], [make_generator(s, logits.device)])[0] for s in range(200)}
    assert seen == allowed
    # min_p 1: only the best token (as greedy); a neighbour without min_p still samples freely
    one = SamplingParams(temperature=1.0, min_p=1.0)
    assert {Sampler()(logits, [one], [make_generator(s, logits.device)])[0] for s in range(50)} == {0}
    both = torch.cat([logits, logits])
    free = {Sampler()(both, [one, SamplingParams(temperature=1.0)],
                      [make_generator(s, logits.device)] * 2)[1] for s in range(200)}
    assert len(free) > 2


def test_token_logprobs_are_the_log_softmax():
    logits = torch.randn(2, V) * 4
    tokens = torch.tensor([3, 7])
    chosen, top, ids = token_logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits.double(), -1)
    assert chosen.tolist() == pytest.approx([ref[0, 3].item(), ref[1, 7].item()], abs=1e-5)
    assert ids.tolist() == ref.topk(3, -1).indices.tolist()
    assert top.flatten().tolist() == pytest.approx(ref.topk(3, -1).values.flatten().tolist(), abs=1e-5)
    assert token_logprobs(logits, tokens, 0)[1].shape == (2, 0)


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(repetition_penalty=0), dict(min_p=1.5),
                                 dict(logit_bias={"x": 1}), dict(logit_bias={"1": 101}), dict(min_tokens=20),
                                 dict(logprobs=21), dict(logit_bias=[1])])
def test_invalid_processor_params_rejected(bad):
    with pytest.raises((ValueError, TypeError)):
        SamplingParams.from_dict(bad)

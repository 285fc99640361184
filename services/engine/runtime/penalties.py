"""Per-request logit processors: logit_bias, min_tokens, and the repetition / frequency / presence penalties.

Dimension legend: n rows that sample · V vocabulary.

Applied by the runner to the rows whose request asks for one, before the sampler (so greedy rows obey
them too), in vLLM's order: logit_bias is added; before ``min_tokens`` tokens the end-of-sequence and
stop ids are at -inf; repetition (CTRL, as transformers and vLLM: the logit of a token seen in the
prompt or the output is divided by the penalty when positive, multiplied when negative); frequency
(minus the penalty times the token's count in the output) and presence (minus the penalty once if the
token is in the output), OpenAI's definitions, which count generated tokens only.

A request's ``LogitState`` keeps its output token counts on the device and adds each sampled token
there, so a chained decode step (launched before the previous step's token reached the host) already
sees it; the constant tensors (bias ids and values, banned ids) are built once per request, so a step
costs no host-to-device copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.runtime.sampler import SamplingParams


@dataclass(eq=False)
class LogitState:
    """What a request's processors need across steps, on the compute device."""

    output_counts: torch.Tensor | None  # [V] fp32: how often each token was generated (penalties)
    prompt_seen: torch.Tensor | None  # [V] bool: the token is in the prompt (repetition_penalty)
    bias_ids: torch.Tensor | None  # [B] int64
    bias_values: torch.Tensor | None  # [B] fp32
    banned_early: torch.Tensor | None  # [E] int64: EOS and stop ids, banned before min_tokens
    sampled: int = 0  # tokens sampled so far (counted at launch: chained steps included)

    @classmethod
    def create(cls, prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
               eos_token_ids: list[int], device: torch.device) -> "LogitState":
        counts = seen = bias_ids = bias_values = banned = None
        if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
            counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            seen[torch.tensor(prompt_token_ids, dtype=torch.long, device=device)] = True
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
        if params.min_tokens:
            ids = sorted({*eos_token_ids, *params.stop_token_ids})
            banned = torch.tensor(ids, dtype=torch.long, device=device) if ids else None
        return cls(counts, seen, bias_ids, bias_values, banned)

    def record(self, token: torch.Tensor) -> None:
        """Count a sampled token ([1] int64, still on the device)."""
        self.sampled += 1
        if self.output_counts is not None:
            self.output_counts.index_add_(0, token, torch.ones(1, dtype=torch.float32, device=token.device))


def apply(logits: torch.Tensor, params: list[SamplingParams], states: list[LogitState | None]) -> torch.Tensor:
    """logits [n, V] fp32 -> the same logits with each row's processors applied (a new tensor when any
    row has one; the input, which the caller may still read for logprobs, is never changed)."""
    rows = [j for j, s in enumerate(states) if s is not None]
    if not rows:
        return logits
    logits = logits.clone()
    for j in rows:
        p, s, row = params[j], states[j], logits[j]  # row: a view, edited in place
        if s.bias_ids is not None:
            row.index_add_(0, s.bias_ids, s.bias_values)
        if s.banned_early is not None and s.sampled < p.min_tokens:
            row.index_fill_(0, s.banned_early, float("-inf"))
        if s.prompt_seen is not None:
            seen = s.prompt_seen | (s.output_counts > 0)
            penalised = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, penalised, row))
        if p.frequency_penalty or p.presence_penalty:
            row.sub_(s.output_counts * p.frequency_penalty + (s.output_counts > 0).float() * p.presence_penalty)
    return logits

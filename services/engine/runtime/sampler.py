"""Batched sampling: greedy, temperature, top-k, top-p, min-p, with one seeded generator per request
(the logit processors, penalties and biases, run before it: penalties.py).

Dimension legend: N sequences in the batch · V vocabulary size.

Reproducibility: each request owns a ``torch.Generator`` seeded by its ``seed`` (or a random seed when
none is given) and draws exactly one random number tensor per generated token, one number per candidate
of its own top-k (the vocabulary without one), so the tokens of a request depend only on its own logits
and seed — never on which other requests share the batch.
Greedy rows (temperature 0) never touch a generator.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from services.engine.runtime.grammar import check_spec

MAX_LOGPROBS = 20  # the most alternatives per token (OpenAI's top_logprobs limit)


@dataclass
class SamplingParams:
    """What a request asks of the sampler and of the stop logic (the engine API's ``sampling`` object)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = -1  # -1 or 0 = whole vocabulary
    seed: int | None = None  # None = a random seed (not reproducible)
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)  # extra stop ids besides the model's EOS
    # logit processors (services/engine/runtime/penalties.py), applied before temperature, greedy rows too
    presence_penalty: float = 0.0  # OpenAI's: minus this once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the token was generated
    repetition_penalty: float = 1.0  # CTRL/transformers': logits of prompt or output tokens / this (> 0: x this)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled before this many tokens
    min_p: float = 0.0  # drop tokens below min_p x the best token's probability (after temperature)
    logprobs: int | None = None  # None: none; k >= 0: each sampled token's logprob and the k best
    # constrained decoding: {"json_schema": {...}} or {"lark": "..."} (services/engine/runtime/grammar.py)
    grammar: dict | None = None

    def __post_init__(self) -> None:
        # Types first: a bad value must be refused here (400), not fail a whole batch on the model thread.
        ints = {"max_tokens": self.max_tokens, "top_k": self.top_k, "min_tokens": self.min_tokens}
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                ints[name] = getattr(self, name)
        for name, value in ints.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {value!r}")
        self.logit_bias = _token_biases(self.logit_bias)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in self.stop_token_ids):
            raise TypeError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        if self.grammar is not None:
            check_spec(self.grammar)
            # a finished grammar allows only EOS: nothing to go on with, and EOS must not be banned
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a grammar")
            if self.min_tokens:
                raise ValueError("min_tokens cannot be combined with a grammar")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def processes_logits(self) -> bool:
        """Whether penalties, biases or min_tokens change this row's logits (penalties.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @classmethod
    def from_dict(cls, data: dict) -> "SamplingParams":
        """Build from the engine API's JSON (unknown keys rejected so typos are not silently ignored)."""
        known = set(cls.__dataclass_fields__)
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling field(s): {', '.join(sorted(unknown))}")
        return cls(**{k: v for k, v in data.items() if v is not None})


def _token_biases(raw) -> dict[int, float]:
    """logit_bias as {token id: bias}; JSON object keys arrive as strings of the ids."""
    if not isinstance(raw, dict):
        raise TypeError(f"logit_bias must be an object of token id -> bias, got {raw!r}")
    out = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100.0 <= bias <= 100.0:
            raise ValueError(f"logit_bias[{key}] must be a number in [-100, 100], got {bias!r}")
        out[token] = float(bias)
    return out


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator for one request on ``device``; a random seed when ``seed`` is None."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed % 2**64 if seed is not None else random.randrange(2**63))  # any int, negatives too
    return gen


class Sampler:
    """Turns last-position logits into next tokens for a batch of requests."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [N, V] fp32 · params/generators one per row -> N token ids on the host (waits for them)."""
        return self.sample(logits, params, generators).tolist()

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [N, V] fp32 · params/generators one per row -> token ids [N] int64 on the logits' device,
        without waiting for them (the engine feeds them to the next step before reading them).

        Greedy rows take the argmax; the others apply temperature, then top-k, then top-p and min-p (on
        the tempered distribution, like transformers' warpers) and draw with the row's generator.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(params) == len(generators), (
            f"sampler: logits {tuple(logits.shape)} vs {len(params)} params / {len(generators)} generators")
        logits = logits.float()
        out = logits.argmax(dim=-1)  # [N]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if rows:
            sub = logits[rows[0]:rows[0] + 1] if len(rows) == 1 else logits[torch.tensor(rows, device=logits.device)]
            probs, token_ids = self._filtered_probs(sub, [params[i] for i in rows])  # [n, K] each
            for j, i in enumerate(rows):  # a row draws over its own candidates: never its neighbours'
                k = self._candidates(params[i], logits.shape[1])
                # gather, not token_ids[j, idx]: indexing with a 0-dim device tensor reads it on the host,
                # a sync that kept the engine from queueing the next step ahead (docs/results/history.md run 27)
                out[i:i + 1] = token_ids[j].gather(0, self._draw(probs[j, :k], generators[i]).view(1))
        return out

    @staticmethod
    def _candidates(p: SamplingParams, V: int) -> int:
        """How many best tokens a row can draw from: its top_k, or the vocabulary without one."""
        return p.top_k if 0 < p.top_k < V else V

    @classmethod
    def _filtered_probs(cls, logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [n, V] -> (probabilities [n, K], their token ids [n, K]) after temperature, top-k and
        top-p (per-row values), over the K best tokens of each row: K = the largest top_k of the rows, V
        when a row has none. Rows sharing one setting (a single request, say) use plain scalars: no
        host-to-device copy of the parameters per token. (A top-k of the 152k logits of Qwen3 instead of
        sorting them all, and no parameter copies: resident decode end to end went from 291 to 320 tok/s
        on the H200 host, docs/results/history.md runs 4 and 9.)"""
        n, V = logits.shape
        dev = logits.device
        ks = [cls._candidates(p, V) for p in params]
        K = max(ks)
        shared = len({(p.temperature, k, p.top_p, p.min_p) for p, k in zip(params, ks)}) == 1

        def per_row(values: list, dtype: torch.dtype):  # [n, 1] tensor, or the scalar all rows share
            return values[0] if shared else torch.tensor(values, device=dev, dtype=dtype)[:, None]

        if K < V:
            top_logits, token_ids = logits.topk(K, dim=-1)  # [n, K], sorted descending
        else:
            top_logits, token_ids = logits.sort(dim=-1, descending=True)
        top_logits = top_logits / per_row([p.temperature for p in params], torch.float32)
        if shared:  # every row keeps all K candidates so far
            drop = torch.zeros_like(top_logits, dtype=torch.bool)
        else:
            drop = torch.arange(K, device=dev)[None, :] >= per_row(ks, torch.int64)  # [n, K] beyond the row's own k
        probs = top_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        top_p = per_row([p.top_p for p in params], torch.float32)
        mass_before = probs.cumsum(dim=-1) - probs  # [n, K] mass of strictly better tokens
        # keeps at least the best token; top_p == 1 filters nothing (fp32 cumsum can reach 1.0 early)
        drop |= (mass_before >= top_p) & (top_p < 1.0)
        if any(p.min_p for p in params):  # probs are sorted: column 0 is each row's best token
            drop |= probs < per_row([p.min_p for p in params], torch.float32) * probs[:, :1]
        return top_logits.masked_fill(drop, float("-inf")).softmax(dim=-1), token_ids

    @staticmethod
    def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """An index into probs [K] (exponential race: argmax p/q, q ~ Exp(1); one draw of K numbers)."""
        q = torch.empty_like(probs).exponential_(generator=generator)
        return (probs / q).argmax()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's own log-probabilities (log-softmax of the raw logits, before penalties, biases and
    temperature: vLLM's default): logits [n, V] fp32 · tokens [n] -> (the tokens' logprobs [n], the k
    best logprobs [n, k] and their ids [n, k]), on the logits' device."""
    logprobs = logits.float().log_softmax(dim=-1)  # [n, V]
    chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1)  # [n]
    top, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], tokens.view(-1, 1)[:, :0])
    return chosen, top, top_ids

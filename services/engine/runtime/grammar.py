"""Constrained decoding: a request's grammar, compiled against the engine's tokenizer, masks the logits
of every step so that only tokens the grammar allows can be sampled.

Dimension legend: n rows of the step that have a grammar · V vocabulary · W = ceil(V / 32) mask words.

The grammar travels in the request's ``sampling`` object (the engine API) as exactly one of

    {"json_schema": {...}}   a JSON Schema; {"type": "object"} is "any JSON object"
    {"lark": "start: ..."}   a grammar in llguidance's Lark dialect (it may embed ``%json {schema}``),
                             which is how the gateway forces a model family's tool-call syntax

The library is llguidance (PyPI, no dependencies; also what vLLM and SGLang can use): it compiles a
schema in milliseconds and fills the masks of a whole batch in parallel on the CPU (benchmarks/
bench_grammar_mask.py measures the cost per token). A grammar that does not compile is refused at
submit (400 naming the reason).

Per step (runner.launch): the forward is queued on the device first, then the masks of the rows with a
grammar are computed on the host (while the device works), copied up and applied to the logits
before sampling (``TokenMasks.apply``) — after a CUDA-graph replay too, since the graph only
produces the logits. Each sampled token then advances its request's matcher (``advance``, from the
scheduler's postprocess), which needs the token on the host: a batch with a grammar row is never
chained ahead of its tokens (decode overlap skips it). Once the grammar is complete only EOS is allowed.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch

from services.common.logging import get_logger

log = get_logger("engine.grammar")

GRAMMAR_KINDS = ("json_schema", "lark")


def check_spec(spec: Any) -> None:
    """Raise TypeError/ValueError unless ``spec`` is {"json_schema": object} or {"lark": string}."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in GRAMMAR_KINDS:
        raise ValueError(f"grammar must be an object with exactly one of {', '.join(GRAMMAR_KINDS)}, "
                         f"got {json.dumps(spec)[:200]}")
    kind, value = next(iter(spec.items()))
    if kind == "json_schema" and not isinstance(value, dict):
        raise TypeError(f"grammar.json_schema must be a JSON object, got {type(value).__name__}")
    if kind == "lark" and not isinstance(value, str):
        raise TypeError(f"grammar.lark must be a string, got {type(value).__name__}")


class GrammarError(ValueError):
    """The grammar cannot be compiled (an invalid schema, a Lark syntax error); the API answers 400."""


class GrammarCompiler:
    """Compiles grammar specs into matchers (one per request) for one tokenizer.

    ``tokenizer_json``: the text of tokenizer.json · ``vocab_size``: V of the model's logits (may exceed
    the tokenizer's; the extra ids are never allowed) · ``eos_token_ids``: what ends a finished grammar."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]):
        from tokenizers import Tokenizer

        self._tokenizer_json = tokenizer_json
        # the masks' width: the larger of the model's vocabulary and the tokenizer's (tiny test models
        # have fewer logits than the tokenizer has tokens; big ones pad their embedding)
        tokens = Tokenizer.from_str(tokenizer_json).get_vocab_size(with_added_tokens=True)
        self.mask_vocab = max(vocab_size, tokens)
        self._eos = list(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()

    def warm_in_background(self) -> None:
        """Build the llguidance tokenizer on a side thread now, so that the first constrained request does
        not convert a 150k vocabulary (~1-4 s) on the API's event loop. llguidance holds the GIL while it
        converts, so this stalls the whole process meanwhile (the GPU warm-up included): its time is logged,
        and a warning names it past WARN_BUILD_S (a tokenizer with 151k *added* tokens took minutes: the
        conversion is quadratic in them, docs/serving.md "Start-up")."""
        def build() -> None:
            t0 = time.perf_counter()
            self.tokenizer  # noqa: B018 - built on first access
            seconds = time.perf_counter() - t0
            (log.warning if seconds > self.WARN_BUILD_S else log.info)(
                "grammar tokenizer (llguidance) built in %.1f s for %d tokens%s", seconds, self.mask_vocab,
                "; it held the GIL meanwhile (many added tokens?)" if seconds > self.WARN_BUILD_S else "")

        threading.Thread(target=build, name="tandem-grammar-warm", daemon=True).start()

    WARN_BUILD_S = 10.0  # a real 150k vocabulary builds in ~1-4 s

    @property
    def tokenizer(self):
        """The llguidance tokenizer, built on first use (~1 s for a 150k vocabulary; 3 ms for the demo's)."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance

                self._tokenizer = llguidance.LLTokenizer(self._tokenizer_json, n_vocab=self.mask_vocab,
                                                         eos_token=self._eos or None)
            return self._tokenizer

    def compile(self, spec: dict):
        """A fresh ``llguidance.LLMatcher`` for ``spec`` (see check_spec); GrammarError says why not."""
        import llguidance

        check_spec(spec)
        kind, value = next(iter(spec.items()))
        try:
            if kind == "json_schema":
                # compact JSON (no free whitespace): a model cannot spend its max_tokens on blanks
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    value, defaults={"whitespace_flexible": False})
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(value)
        except ValueError as exc:
            raise GrammarError(f"grammar cannot be compiled: {exc}") from exc
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"grammar cannot be compiled: {matcher.get_error().strip()}")
        return matcher


def advance(matcher, token_id: int) -> None:
    """Feed a sampled token to its request's matcher (EOS after a finished grammar is a no-op)."""
    if matcher.is_stopped():
        return
    if not matcher.consume_token(token_id):  # cannot happen for a token sampled under the mask
        log.error("grammar rejected token %d: %s", token_id, matcher.get_error())


class TokenMasks:
    """Applies the grammar masks of a step's rows to their logits, in place, on the logits' device.
    ``mask_vocab``: the width of the matchers' masks (GrammarCompiler.mask_vocab)."""

    def __init__(self, mask_vocab: int):
        self.mask_vocab = max(mask_vocab, 1)
        self._executor = None
        self._bits: dict[torch.device, torch.Tensor] = {}  # [8] uint8: 1, 2, 4, ..., 128

    def fill(self, matchers: list, pin: bool = False) -> torch.Tensor:
        """The next-token masks of ``matchers`` (none None), filled in parallel on the host:
        [n, W] int32, bit t % 32 of word t // 32 set when token t is allowed (``pin``: in pinned memory)."""
        import llguidance
        import llguidance.torch as llg_torch

        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        bitmask = torch.full((len(matchers), (self.mask_vocab + 31) // 32), -1, dtype=torch.int32, pin_memory=pin)
        llg_torch.fill_next_token_bitmask_par(self._executor, [(m, j) for j, m in enumerate(matchers)], bitmask)
        return bitmask

    def apply(self, logits: torch.Tensor, matchers: list) -> None:
        """logits [N, V] fp32 · matchers one per row (None = no grammar): the rows with a matcher get -inf
        wherever their grammar forbids the token."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return
        n, V = len(rows), logits.shape[1]
        bitmask = self.fill([matchers[i] for i in rows], pin=logits.device.type == "cuda")  # [n, W]
        forbidden = self._forbidden(bitmask.to(logits.device, non_blocking=True), V)  # [n, V] bool
        if n == logits.shape[0]:  # every row constrained (a lone request): no gather / scatter
            logits.masked_fill_(forbidden, float("-inf"))
            return
        index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))

    def _forbidden(self, words: torch.Tensor, V: int) -> torch.Tensor:
        """words [n, W] int32 (bit t % 32 of word t // 32 = token t allowed) -> [n, V] bool, True where
        forbidden. Unpacked byte-wise (little-endian: bit t % 8 of byte t // 8), one byte per token: a
        [n, W, 32] int32 unpacking moved 4x the memory (B=32 of a 152k vocabulary: 19 MB a step)."""
        bits = self._bits.get(words.device)
        if bits is None:
            bits = self._bits[words.device] = 1 << torch.arange(8, dtype=torch.uint8, device=words.device)
        n = words.shape[0]
        return ((words.view(torch.uint8)[:, :, None] & bits) == 0).view(n, -1)[:, :V]

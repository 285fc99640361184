"""Continuous batching: which requests run in the next forward, and what happens after it.

A step's batch holds prompt chunks (prefill: up to ``max_prefill_tokens`` prompt tokens per step, the
requests still prefilling first, then newly admitted ones) followed by every request past its prompt
(one token each: decode), all in one ``ForwardBatch`` — tokens of one sequence contiguous. A prompt
longer than the budget is prefilled over several steps (chunked prefill), so a long prompt never stalls
the running requests' decode for more than one budget's worth of compute; only the step that finishes
a prompt samples its first token. Requests wait in a bounded FIFO queue; each running request owns
one KV slot (``max_running_requests`` slots in all) until it finishes or is aborted.

Prefix cache: a freed slot keeps the K/V of the tokens its request computed. A new request takes the
free slot holding the longest prefix of its prompt (else the least recently freed one), or, when a
running request's slot holds a longer prefix (a system prompt shared by users), a copy of that prefix
into its slot (``ScheduledBatch.kv_copies``, done by the runner before the forward);
its prefill then starts after the prefix. The last prompt token is always computed (its logits give the
first token).

``one_prompt_per_step`` (--batch-invariant): a step holds at most one prompt chunk, which gets the whole
prefill budget, so a prompt is cut into the same chunks whatever else is waiting or prefilling.

Everything here runs on the engine thread; only ``Request.emit`` crosses to the API side.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from services.engine.runtime.grammar import advance
from services.engine.runtime.sampler import SamplingParams


PENDING = -1  # an input id not on the host yet: the previous step's sample, still on the device


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS / stop token was sampled
    LENGTH = "length"  # max_tokens reached (or the sequence hit max_seq_len)
    ABORT = "abort"  # the client went away or asked to abort


class QueueFullError(RuntimeError):
    """The waiting queue is at --max-waiting-requests; the API answers 429."""


class InvalidRequestError(ValueError):
    """A request the engine can never serve as asked; the API answers 400."""


class RequestTooLongError(InvalidRequestError):
    """prompt + max_tokens exceeds --max-seq-len; the API answers 400."""


@dataclass(eq=False)  # identity semantics: list.remove/in must never compare fields
class Request:
    """One generation request as the engine thread sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[dict], None]  # called on the engine thread with each output (see Scheduler._output)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # prompt tokens whose K/V are in the cache (chunked prefill)
    num_cached: int = 0  # of those, the prefix taken from the prefix cache (not computed for this request)
    slot: int | None = None
    generator: torch.Generator | None = None  # created by the runner on the compute device
    logit_state: Any = None  # penalties.LogitState, created by the runner when the params need one
    grammar: Any = None  # the llguidance matcher of params.grammar (runtime/grammar.py), compiled at submit
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_token_ids)

    def computed_tokens(self) -> list[int]:
        """The tokens whose K/V are in this request's slot, in position order (the last sampled token is
        not: it is fed by the next step)."""
        if self.prefilling:
            return self.prompt_token_ids[:self.num_computed]
        return (self.prompt_token_ids + self.output_token_ids)[:self.num_tokens - 1]


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, at most ``limit``."""
    n = 0
    for x, y in zip(a[:limit], b[:limit]):
        if x != y:
            break
        n += 1
    return n


@dataclass
class ScheduledBatch:
    """One forward's worth of work: ``requests[:num_prefill]`` prompt chunks, the rest decode one token."""

    requests: list[Request]
    num_prefill: int
    input_ids: list[int]  # [T] concatenated per sequence; PENDING in a chained batch (continue_batch)
    positions: list[int]  # [T]
    slots: list[int]  # [N]
    start_pos: list[int]  # [N] tokens already in each slot's cache
    query_lens: list[int]  # [N]
    # (source slot, destination slot, tokens): K/V prefixes the runner copies before the forward, in order
    kv_copies: list[tuple[int, int, int]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens of the requests admitted in this step taken from the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def samples(self) -> list[bool]:
        """[N] whether each row samples a token: False for a prompt chunk that does not end its prompt."""
        return [i >= self.num_prefill or start + n == len(req.prompt_token_ids)
                for i, (req, start, n) in enumerate(zip(self.requests, self.start_pos, self.query_lens))]


class Scheduler:
    """FIFO admission into a fixed set of KV slots; stop checks after each step."""

    def __init__(self, max_running: int, max_waiting: int, max_seq_len: int, eos_token_ids: list[int],
                 max_prefill_tokens: int | None = None, prefix_cache: bool = True, one_prompt_per_step: bool = False):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_seq_len = max_seq_len
        self.eos_token_ids = set(eos_token_ids)
        # Prompt tokens computed per step (longer prompts are chunked): bounds how long one step can stall
        # the running requests' decode. Default: whole prompts (max_seq_len), as chunks of an offloaded
        # model each fetch the experts they touch again.
        self.max_prefill_tokens = max_prefill_tokens or max(max_seq_len, 2048)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_running))  # least recently freed first
        self.prefix_cache = prefix_cache
        self.one_prompt_per_step = one_prompt_per_step
        self.slot_tokens: dict[int, list[int]] = {}  # free slot -> the tokens whose K/V it still holds
        self.prompt_tokens_total = 0  # prompt tokens of admitted requests
        self.cached_tokens_total = 0  # of those, taken from the prefix cache

    # -- admission ---------------------------------------------------------------------------
    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestTooLongError if the request can never fit in one KV slot."""
        if prompt_len == 0:
            raise InvalidRequestError("prompt_token_ids is empty; give at least one token")
        if prompt_len + params.max_tokens > self.max_seq_len:
            raise RequestTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                f"{prompt_len + params.max_tokens} exceeds the engine's --max-seq-len {self.max_seq_len}")

    def add(self, req: Request) -> None:
        """Queue a request (FIFO). Raises QueueFullError / RequestTooLongError."""
        self.check(len(req.prompt_token_ids), req.params)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"waiting queue full ({self.max_waiting} requests, --max-waiting-requests)")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        """Prompt chunks within the prefill budget (requests still prefilling first, then newly admitted
        ones into free slots), then one decode token for every request past its prompt."""
        chunks: list[tuple[Request, int]] = []
        budget = self.max_prefill_tokens
        for req in self.running:
            if req.prefilling and budget > 0 and not (self.one_prompt_per_step and chunks):
                n = min(len(req.prompt_token_ids) - req.num_computed, budget)
                chunks.append((req, n))
                budget -= n
        kv_copies: list[tuple[int, int, int]] = []
        admitted: list[Request] = []
        while self.waiting and self.free_slots and budget > 0 and not (self.one_prompt_per_step and chunks):
            req = self.waiting.popleft()
            self._admit(req, kv_copies)
            admitted.append(req)
            self.running.append(req)
            n = min(len(req.prompt_token_ids) - req.num_computed, budget)
            chunks.append((req, n))
            budget -= n
        decoding = [r for r in self.running if not r.prefilling]
        if not chunks and not decoding:
            return None
        batch = ScheduledBatch([r for r, _ in chunks] + decoding, len(chunks), [], [], [], [], [], kv_copies,
                               sum(r.num_cached for r in admitted))
        for req, n in chunks:
            start = req.num_computed
            batch.input_ids += req.prompt_token_ids[start:start + n]
            batch.positions += range(start, start + n)
            batch.slots.append(req.slot)
            batch.start_pos.append(start)
            batch.query_lens.append(n)
        for req in decoding:
            pos = req.num_tokens - 1  # the last sampled token is not in the cache yet
            batch.input_ids.append(req.output_token_ids[-1])
            batch.positions.append(pos)
            batch.slots.append(req.slot)
            batch.start_pos.append(pos)
            batch.query_lens.append(1)
        return batch

    def _admit(self, req: Request, kv_copies: list[tuple[int, int, int]]) -> None:
        """Give ``req`` a free slot and the longest cached prefix of its prompt (see the module doc)."""
        prompt = req.prompt_token_ids
        limit = len(prompt) - 1 if self.prefix_cache else 0
        matches = [(common_prefix(self.slot_tokens.get(s, []), prompt, limit), s) for s in self.free_slots]
        own, slot = max(matches, key=lambda m: m[0])  # ties: the least recently freed slot (first in the list)
        best, source = own, slot
        for other in self.running:  # a prefix another request computed (a shared system prompt)
            n = common_prefix(other.computed_tokens(), prompt, limit)
            if n > best:
                best, source = n, other.slot
        if source != slot:
            kv_copies.append((source, slot, best))
        self.free_slots.remove(slot)
        self.slot_tokens.pop(slot, None)  # while it runs, the request describes what its slot holds
        req.slot, req.num_computed, req.num_cached = slot, best, best
        self.prompt_tokens_total += len(prompt)
        self.cached_tokens_total += best

    def continue_batch(self, batch: ScheduledBatch) -> ScheduledBatch | None:
        """The next decode step of ``batch``'s requests, built before its tokens are known (a chained
        step: input ids ``PENDING``, to be taken from the batch's samples on the device), or None when the
        next step must be scheduled after ``postprocess``: a row did not sample (mid-prompt), a row's
        pending token surely ends it (max_tokens, max_seq_len), another request runs or can be admitted.
        A row whose pending token turns out to be a stop token computes one token that ``postprocess``
        then drops (the request has finished)."""
        if len(self.running) != len(batch.requests) or (self.waiting and self.free_slots):
            return None
        if not all(batch.samples):
            return None
        reqs = batch.requests
        if any(r.grammar is not None for r in reqs):  # its mask needs the pending token on the host
            return None
        if any(len(r.output_token_ids) + 1 >= r.params.max_tokens or r.num_tokens + 1 >= self.max_seq_len for r in reqs):
            return None
        positions = [r.num_tokens for r in reqs]  # where the pending token goes
        return ScheduledBatch(list(reqs), 0, [PENDING] * len(reqs), positions, [r.slot for r in reqs],
                              list(positions), [1] * len(reqs))

    def postprocess(self, batch: ScheduledBatch, token_ids: list[int | None],
                    logprobs: list[dict | None] | None = None) -> None:
        """Record the step's prompt chunks, append each sampled token (None: a chunk that did not end its
        prompt), emit it (with its logprobs entry when the request asked), and retire finished requests
        (slot freed at once)."""
        now = time.monotonic()
        for req, n in zip(batch.requests[:batch.num_prefill], batch.query_lens):
            req.num_computed += n
        for i, (req, tok) in enumerate(zip(batch.requests, token_ids)):
            if req.finish_reason is not None or tok is None:  # aborted while the step ran, or mid-prompt
                continue
            req.output_token_ids.append(tok)
            if req.grammar is not None:
                advance(req.grammar, tok)
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            p = req.params
            if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
                req.finish_reason, req.stop_token_id = FinishReason.STOP, tok
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_seq_len:
                req.finish_reason = FinishReason.LENGTH
            if req.finish_reason is not None:  # freed before the client hears of the end, so stats agree
                self._release(req)
            out = self._output(req, [tok])
            if logprobs is not None and logprobs[i] is not None:
                out["logprobs"] = [logprobs[i]]
            req.emit(out)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request wherever it is; frees its slot. Returns it, or None if unknown (already done)."""
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                break
        else:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is None:
                return None
            self._release(req)
        req.finish_reason = FinishReason.ABORT
        req.emit(self._output(req, []))
        return req

    def abort_all(self, reason: str) -> None:
        """Abort every request (engine shutting down or failed)."""
        for req in list(self.waiting) + list(self.running):
            self.abort(req.request_id)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.slot_tokens[req.slot] = req.computed_tokens() if self.prefix_cache else []
            self.free_slots.append(req.slot)
            req.slot = None

    @staticmethod
    def _output(req: Request, token_ids: list[int]) -> dict:
        """One line of the engine API's NDJSON stream."""
        out = {"token_ids": token_ids,
               "finish_reason": req.finish_reason.value if req.finish_reason else None,
               "prompt_tokens": len(req.prompt_token_ids),
               "completion_tokens": len(req.output_token_ids), "cached_tokens": req.num_cached}
        if req.stop_token_id is not None:
            out["stop_token_id"] = req.stop_token_id
        return out

    def stats(self) -> dict:
        used = sum(r.num_tokens for r in list(self.running))  # snapshot: read from the API thread too
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_slots_used": self.max_running - len(self.free_slots), "kv_slots_total": self.max_running,
                "kv_tokens_used": used, "kv_tokens_total": self.max_running * self.max_seq_len,
                "kv_usage": used / (self.max_running * self.max_seq_len),
                "prefix_cache": {"enabled": self.prefix_cache, "prompt_tokens": self.prompt_tokens_total,
                                 "cached_tokens": self.cached_tokens_total}}

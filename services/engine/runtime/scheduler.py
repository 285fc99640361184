"""Continuous batching: which requests run in the next forward, and what happens after it.

A step's batch holds prompt chunks (prefill: up to ``max_prefill_tokens`` prompt tokens per step, the
requests still prefilling first, then newly admitted ones) followed by every request past its prompt
(one token each: decode), all in one ``ForwardBatch`` — tokens of one sequence contiguous. A prompt
longer than the budget is prefilled over several steps (chunked prefill), so a long prompt never stalls
the running requests' decode for more than one budget's worth of compute; only the step that finishes
a prompt samples its first token. Requests wait in a bounded FIFO queue; a running request owns one of
``max_running_requests`` slots (its row of the block table) and the KV blocks it has grown into.

KV memory (the paged cache, block_manager.py): every step each running request, oldest first, gets the
blocks its new tokens need. A prompt chunk shrinks to the free blocks; a request that gets none — a
decode row, or a chunk with not one block left — takes them from the newest running request, which is
preempted: its blocks go back, it returns to the head of the queue, and it is prefilled again later
(recompute: its full blocks stay in the prefix cache while nothing else needs them, so that is mostly a
cache hit) — never a failed forward. A request is admitted when the free blocks cover its first chunk
and leave one block per decoding request (the next step's growth), and not in a step that preempted.

Prefix cache: the blocks of computed tokens, shared in whole blocks (block_manager.py). A new request
starts after the longest cached block prefix of its prompt; the last prompt token is always computed
(its logits give the first token).

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

from services.engine.runtime.block_manager import BlockManager
from services.engine.runtime.grammar import advance
from services.engine.runtime.kv_cache import BLOCK_SIZE
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
    """prompt + max_tokens exceeds --max-seq-len or the KV pool; the API answers 400."""


@dataclass(eq=False)  # identity semantics: list.remove/in must never compare fields
class Request:
    """One generation request as the engine thread sees it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[dict], None]  # called on the engine thread with each output (see Scheduler._output)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache (prompt chunks, then one per decode step)
    num_cached: int = 0  # prompt tokens taken from the prefix cache at admission (not computed for it)
    num_preemptions: int = 0  # times its KV blocks were taken back (it was prefilled again)
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
    def prefill_len(self) -> int:
        """Tokens to compute before it decodes: its prompt, or after a preemption every token but the last
        sampled one (which the next decode step feeds)."""
        return self.num_tokens - 1 if self.output_token_ids else len(self.prompt_token_ids)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    def tokens(self, start: int, end: int) -> list[int]:
        """Its tokens (prompt, then output) at positions [start, end)."""
        P = len(self.prompt_token_ids)
        if end <= P:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[max(0, start - P):end - P]


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
    cached_tokens: int = 0  # prompt tokens of the requests admitted in this step taken from the prefix cache

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def samples(self) -> list[bool]:
        """[N] whether each row samples a token: False for a prompt chunk that does not end its prompt."""
        return [i >= self.num_prefill or (start + n == len(req.prompt_token_ids) and not req.output_token_ids)
                for i, (req, start, n) in enumerate(zip(self.requests, self.start_pos, self.query_lens))]


class Scheduler:
    """FIFO admission into request slots and KV blocks; preemption when blocks run out; stop checks."""

    def __init__(self, max_running: int, max_waiting: int, max_seq_len: int, eos_token_ids: list[int],
                 max_prefill_tokens: int | None = None, prefix_cache: bool = True, one_prompt_per_step: bool = False,
                 blocks: BlockManager | None = None):
        """``blocks``: the KV pool's manager, which also says whether the prefix cache is on (default: room for
        ``max_running`` requests of ``max_seq_len``, the prefix cache as ``prefix_cache`` says)."""
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.max_seq_len = max_seq_len
        self.eos_token_ids = set(eos_token_ids)
        # Prompt tokens computed per step (longer prompts are chunked): bounds how long one step can stall
        # the running requests' decode. Default: whole prompts.
        self.max_prefill_tokens = max_prefill_tokens or max(max_seq_len, 2048)
        if blocks is None:
            blocks = BlockManager(1 + max_running * -(-max_seq_len // BLOCK_SIZE), BLOCK_SIZE, max_running,
                                  max_seq_len, prefix_cache)
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the newest is preempted first
        self.free_slots: list[int] = list(range(max_running))
        self.one_prompt_per_step = one_prompt_per_step
        self.prompt_tokens_total = 0  # prompt tokens of admitted requests
        self.cached_tokens_total = 0  # of those, taken from the prefix cache
        self.preemptions_total = 0

    # -- admission ---------------------------------------------------------------------------
    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raise RequestTooLongError if the request can never fit (--max-seq-len, or the whole KV pool)."""
        if prompt_len == 0:
            raise InvalidRequestError("prompt_token_ids is empty; give at least one token")
        need = prompt_len + params.max_tokens
        if need > self.max_seq_len:
            raise RequestTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = "
                f"{need} exceeds the engine's --max-seq-len {self.max_seq_len}")
        pool = self.blocks.num_usable * self.blocks.block_size
        if need > pool:
            raise RequestTooLongError(
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {need} exceeds the KV "
                f"cache's {pool} tokens (--kv-cache-memory)")

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
        """Blocks for the running requests' next tokens, oldest first (prompt chunks within the prefill
        budget, one decode token each; preempting the newest when blocks run out), then newly admitted
        requests' first chunks (module docstring)."""
        chunks: list[tuple[Request, int]] = []
        decoding: list[Request] = []
        budget = self.max_prefill_tokens
        preempted = self.preemptions_total
        for req in list(self.running):
            if req not in self.running:  # preempted for an older request in this loop
                continue
            if not req.prefilling:
                if self._grow(req, req.num_computed + 1):
                    decoding.append(req)
                continue
            if budget <= 0 or (self.one_prompt_per_step and chunks):
                continue
            n = self._fit(req, min(req.prefill_len - req.num_computed, budget))
            if n == 0 and self._grow(req, req.num_computed + 1):  # not one block free: take one from the newest
                n = self._fit(req, min(req.prefill_len - req.num_computed, budget))
            if n > 0:
                chunks.append((req, n))
                budget -= n
        admitted: list[Request] = []
        if self.preemptions_total > preempted:  # blocks ran out this step: admitting now would only thrash
            budget = 0
        while self.waiting and self.free_slots and budget > 0 and not (self.one_prompt_per_step and chunks):
            req = self.waiting[0]
            n = self._admit(req, budget, reserve=len(decoding))
            if n == 0:
                break
            self.waiting.popleft()
            admitted.append(req)
            self.running.append(req)
            chunks.append((req, n))
            budget -= n
        if not chunks and not decoding:
            return None
        batch = ScheduledBatch([r for r, _ in chunks] + decoding, len(chunks), [], [], [], [], [],
                               sum(r.num_cached for r in admitted if not r.num_preemptions))
        for req, n in chunks:
            start = req.num_computed
            batch.input_ids += req.tokens(start, start + n)
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

    def _fit(self, req: Request, n: int) -> int:
        """The most of ``n`` new tokens of ``req`` its blocks and the free ones hold; those blocks taken."""
        bs = self.blocks.block_size
        room = len(self.blocks.tables[req.slot]) * bs - req.num_computed + self.blocks.num_free * bs
        n = min(n, room)
        if n > 0:
            self.blocks.grow(req.slot, req.num_computed + n)
        return max(n, 0)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions of ``req``, preempting the newest running requests until they
        fit; False when ``req`` itself was the newest and got preempted."""
        while not self.blocks.grow(req.slot, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Take ``req``'s blocks back and queue it first: it is prefilled again (recompute) when it fits."""
        self._release(req)
        req.num_computed = 0
        req.num_preemptions += 1
        self.preemptions_total += 1
        self.waiting.appendleft(req)

    def _admit(self, req: Request, budget: int, reserve: int) -> int:
        """Give ``req`` a free slot, its cached prefix and the blocks of its first chunk (at most ``budget``
        tokens), leaving ``reserve`` blocks free; returns the chunk's length, 0 (nothing taken) when it
        does not fit now."""
        slot = self.free_slots[0]
        hit = self.blocks.admit(slot, req.tokens(0, req.prefill_len))
        n = min(req.prefill_len - hit, budget, (self.blocks.num_free - reserve) * self.blocks.block_size)
        if n <= 0 or not self.blocks.grow(slot, hit + n):
            self.blocks.free(slot)
            return 0
        self.free_slots.pop(0)
        req.slot, req.num_computed = slot, hit
        if not req.num_preemptions:  # its first admission: what the client is told was cached
            req.num_cached = hit
            self.prompt_tokens_total += len(req.prompt_token_ids)
            self.cached_tokens_total += hit
        return n

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
        if not all(self.blocks.grow(r.slot, r.num_tokens + 1) for r in reqs):  # out of blocks: schedule() preempts
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
        for req, n in zip(batch.requests, batch.query_lens):
            if req.slot is None:  # finished (or aborted) while a chained step ran: nothing of it is kept
                continue
            req.num_computed += n
            self.blocks.commit(req.slot, req.num_computed, req.tokens)  # newly full blocks join the prefix cache
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

    def abort(self, request_id: str, error: str | None = None) -> Request | None:
        """Drop a request wherever it is; frees its slot and blocks; ``error`` (the engine failed it) goes
        into its last output. Returns it, or None if unknown (already done)."""
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
        out = self._output(req, [])
        if error is not None:
            out["error"] = error
        req.emit(out)
        return req

    def abort_all(self, reason: str, error: str | None = None) -> None:
        """Abort every request (engine shutting down or failed); ``error``: why, in each one's last output."""
        for req in list(self.waiting) + list(self.running):
            self.abort(req.request_id, error)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.slot is not None:
            self.blocks.free(req.slot)
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
        """Requests and KV blocks; ``kv_usage`` = blocks held by running requests / all blocks (the meaning
        of vLLM's kv_cache_usage_perc, which inference gateways read)."""
        blocks = self.blocks.stats()
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_slots_used": self.max_running - len(self.free_slots), "kv_slots_total": self.max_running,
                **blocks, "kv_tokens_used": blocks["kv_blocks_used"] * self.blocks.block_size,
                "kv_tokens_total": blocks["kv_blocks_total"] * self.blocks.block_size,
                "preemptions": self.preemptions_total,
                "prefix_cache": {"enabled": self.blocks.prefix_cache, "prompt_tokens": self.prompt_tokens_total,
                                 "cached_tokens": self.cached_tokens_total}}

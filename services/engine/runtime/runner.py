"""Runs one scheduled batch: build the model inputs, one forward over the KV cache, sample.

``launch`` queues all of it on the device and returns; ``collect`` waits for the sampled ids on the host
(``run`` = both). Between the two the engine may launch the next step of the same requests, fed by this
step's samples on the device (decode overlap, services/engine/step_loop.py). Rows with a grammar
(constrained decoding, ``grammar.py``) get their token masks applied to the logits before sampling,
eager or replayed alike.

Dimension legend: T tokens in the step · N sequences in the step · V vocabulary · S KV slots.

The runner owns the KV cache (the paged pool of the scheduler's BlockManager, whose block table it copies to
the device before a forward when blocks were taken or freed; ``S = max_running_requests`` rows plus one
padding row of null blocks) and the sampler; the model is the registry's ``MoECausalLM``
(contract: ``forward(input_ids [T], positions [T], ForwardBatch, KVCache) -> logits [N, V]``).

On CUDA, decode steps (one token per sequence) replay CUDA graphs captured at start for every batch size
1..max_running_requests (tqdm bar and ``progress`` phase "capturing"): an eager decode step costs ~20
launches x L layers x ~19 us (docs/design.md §6: ~18 ms/token at 48 layers), a replay one launch, and a
graph per size means no padding rows (a padding row routes to real experts: with the grouped expert GEMM
it would add their weight reads to the step). Each graph is checked against an eager forward once after
capture (hybrid holds its split meanwhile, ``same_split``, so both passes compute each expert on the same
side; the largest difference is logged); a size that fails to capture or to match runs eager (logged), so a backend that is not graph-safe
costs speed, never correctness. Before the capture, ``warm_up`` compiles the expert kernels of every step
size (the backend's ``warm``) and runs one eager prefill, so no JIT compile or lazy module load lands on a
request (progress phase "compiling"); a Triton compile after that is logged as a warning naming the kernel's
specialization (``compile_watch.py``). A step with prompt chunks and decode rows runs the chunks eagerly and
the decode rows by replay (``_forward_mixed``).

``batch_invariant`` (--batch-invariant, docs/serving.md): a row's arithmetic must not depend on the other rows
of its step. Every kernel of a decode step computes a row the same way at a given number of rows (cuBLAS picks
its kernel by M, the expert GEMM its tile config by routes per expert, decode attention its chunks by the
window), so every decode step runs at ONE size: max_running_requests rows, the unused ones padded (token 0 at
position 0 of the spare KV slot, which no request owns), by replaying the one graph of that size (only it is
captured) or, without graphs, eagerly at that size. Each prompt chunk runs in a forward of its own (the
scheduler gives a step at most one), never packed with another prompt or with decode rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from tqdm import tqdm

from services.common.logging import get_logger
from services.common.settings import env
from services.engine.runtime import penalties
from services.engine.runtime.compile_watch import CompileWatch
from services.engine.runtime.grammar import TokenMasks
from services.engine.runtime.sampler import Sampler, make_generator, token_logprobs
from services.engine.runtime.scheduler import ScheduledBatch

log = get_logger("runner")

# Backends whose decode path is capturable as a whole (no host sync, no Python-side decisions per
# step). Others may say so themselves with a ``cuda_graph_safe = True`` attribute.
GRAPH_SAFE_BACKENDS = ("resident", "offload")


class ModelRunner:
    """One forward + sample per engine step, on the model's device."""

    def __init__(self, loaded, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype,
                 backend_name: str = "resident", eos_token_ids: list[int] = (),
                 masks: TokenMasks | None = None, progress=None, batch_invariant: bool = False, blocks=None):
        """``eos_token_ids``: the ids min_tokens bans until a request has generated enough;
        ``masks``: the grammar masks of constrained rows (default: as wide as the model's vocabulary);
        ``progress``: gets ``{"phase": "compiling" | "capturing", "done", "total", "fraction"}`` on CUDA;
        ``batch_invariant``: every decode step at max_running_requests rows, prompts alone (module docstring);
        ``blocks``: the scheduler's BlockManager, whose pool this runner's KV cache is (None: a dense cache,
        each slot holding max_seq_len tokens: runners driven without a scheduler)."""
        from services.engine.runtime.kv_cache import KVCache  # model helper's module

        self.loaded = loaded
        self.eos_token_ids = list(eos_token_ids)
        self.model = loaded.model
        self.device = device
        self.sampler = Sampler()
        self.masks = masks or TokenMasks(loaded.spec.vocab_size)  # grammar masks (constrained decoding)
        self.graphs: DecodeGraphs | None = None
        # Graphs are allowed on CUDA unless turned off; they are captured while the backend is graph-safe
        # (`auto` may swap backends later and call recapture()).
        # A routing trace reads each step's expert ids back in Python: no graphs while recording.
        self.graphs_enabled = device.type == "cuda" and env("TANDEM_CUDA_GRAPHS") != "0" and self.model.recorder is None
        self._graph_safe_default = backend_name in GRAPH_SAFE_BACKENDS
        self.batch_invariant = batch_invariant
        # one spare slot for padding rows (graph replays, batch-invariant decode steps): no request owns it;
        # in a paged cache its row of the block table is all null blocks
        padded = self.graphs_enabled or batch_invariant or blocks is not None
        self.blocks, self._tables_version = blocks, -1
        if blocks is None:
            self.kv = KVCache(loaded.spec, num_slots + int(padded), max_seq_len, device, dtype)
        else:
            self.kv = KVCache(loaded.spec, num_slots + 1, max_seq_len, device, dtype, num_blocks=blocks.num_blocks,
                              block_size=blocks.block_size)
        self.num_slots = num_slots
        self.pad_slot = num_slots if padded else None
        if self.model.routing is not None:  # a salt per slot, padding slot included, before any capture
            self.model.routing.reserve(num_slots + 1)
        self.progress = progress
        if device.type == "cuda":
            self.warm_up()
        if self.graphs_enabled:
            self._capture()
        self.compile_watch = CompileWatch()  # from here on a Triton compile is a warm-up miss: logged, counted
        if device.type == "cuda":
            self.compile_watch.start()

    def close(self) -> None:
        """Stop watching Triton compiles (its hooks are process-wide: a runner left watching would report
        the next runner's start-up compiles as compiles while serving)."""
        self.compile_watch.stop()

    def recapture(self) -> None:
        """Capture the decode graphs again after the expert backend was rebuilt (an `auto` profile
        reload): the old graphs replay the old backend's buffers. Graphs stay off if they were off."""
        if not self.graphs_enabled:
            return
        self.graphs = None
        torch.cuda.empty_cache()
        self._capture()

    WARM_PREFILL_TOKENS = 64  # the warm-up prefill's length (any length meets the same compiled kernels)

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile before serving what a request would otherwise compile or load on first use: the expert
        kernels at every size class (``backend.warm``: the GEMV, the grouped GEMM with each launch config)
        and one eager prefill forward (cuBLAS / SDPA modules, the prefill path's Triton kernels) into slot 0,
        then the same tokens as two packed prompts into slots 0 and 1 (the biased SDPA kernel of packed
        prefill), then one eager decode step in slot 0; the slots hold nothing yet (the prefix cache only
        reuses slots that requests freed)."""
        t0 = time.perf_counter()
        self._report("compiling", 0, 2)
        warm = getattr(self.model.backend, "warm", None)
        hidden = torch.zeros(1, self.loaded.spec.hidden_size, dtype=self.kv.dtype, device=self.device)
        calls = warm(hidden) if warm is not None else 0
        self._report("compiling", 1, 2)
        from services.engine.runtime.kv_cache import ForwardBatch

        T = min(self.WARM_PREFILL_TOKENS, self.kv.max_seq_len)
        ids = torch.ones(T, dtype=torch.long, device=self.device)
        pos = torch.arange(T, device=self.device)
        self.model(ids, pos, ForwardBatch(slots=[0], start_pos=[0], query_lens=[T]), self.kv)
        packed = self.kv.num_slots > 1 and T > 1
        if packed:  # two prompts in slots 0 and 1: the packed prefill attention's biased kernel (attention.py)
            h = T // 2
            self.model(ids, torch.cat([pos[:h], pos[:T - h]]),
                       ForwardBatch(slots=[0, 1], start_pos=[0, 0], query_lens=[h, T - h]), self.kv)
        # one eager decode step (every row query_len 1): what an eager all-1-token forward launches on a request
        # (a prompt's 1-token last chunk after a prefix-cache hit, graphs off, a batch no graph fits); the
        # decode attention's window is always the whole cache (attention.py), so this one covers them all
        p = min(T, self.kv.max_seq_len - 1)
        self.model(ids[:1], torch.full((1,), p, device=self.device),
                   ForwardBatch(slots=[0], start_pos=[p], query_lens=[1]), self.kv)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._report("compiling", 2, 2)
        log.info("kernels warmed in %.1f s (%d expert-kernel calls, a %d-token prefill%s, an eager decode step)",
                 time.perf_counter() - t0, calls, T, ", then as two packed prompts" if packed else "")

    def _report(self, phase: str, done: int, total: int) -> None:
        if self.progress is not None:
            self.progress({"phase": phase, "done": done, "total": total, "fraction": done / max(total, 1)})

    def _capture(self) -> None:
        if getattr(self.model.backend, "cuda_graph_safe", self._graph_safe_default):
            sizes = [self.num_slots] if self.batch_invariant else None  # None: every size
            self.graphs = DecodeGraphs(self.model, self.kv, self.num_slots, self.pad_slot, sizes)
            self.graphs.capture(lambda done, total: self._report("capturing", done, total))
        else:
            log.info("expert backend is not CUDA-graph safe: decode steps run eagerly")

    def can_replay(self, num_rows: int) -> bool:
        """Whether a decode step of ``num_rows`` sequences replays a captured graph."""
        return self.graphs is not None and any(b >= num_rows for b in self.graphs.graphs)

    def run(self, batch: ScheduledBatch) -> list[int | None]:
        """Forward the batch and return one sampled token id per sequence (N entries; None for a prompt
        chunk that does not end its prompt: nothing is sampled, its generator is not touched)."""
        return self.collect(self.launch(batch))

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: "LaunchedStep | None" = None) -> "LaunchedStep":
        """Queue the batch's forward and sampling on the device and return without waiting for them.

        ``after``: the step before, whose sampled tokens (still on the device) are this batch's input
        ids, row for row (a chained batch, ``Scheduler.continue_batch``). On CUDA the tokens are copied
        to pinned memory behind the sampling, and ``collect`` waits for that copy alone."""
        launched_at = time.perf_counter()  # before the forward: on the CPU it runs right here, synchronously
        ids = after.tokens if after is not None else None  # [N] on the device
        if self.model.routing is not None:  # a routing preset: each request its own random numbers
            self.model.routing.assign(batch.slots, [r.request_id for r in batch.requests])
        recorder = self.model.recorder
        if recorder is not None:
            recorder.begin_step([r.request_id for r in batch.requests], batch.start_pos, batch.query_lens)
        if self.blocks is not None and self.blocks.version != self._tables_version:  # blocks taken or freed
            self.kv.load_tables(self.blocks.host_table, self.blocks.cols)
            self._tables_version = self.blocks.version
        logits = None
        if self.batch_invariant:
            logits = self._forward_invariant(batch, ids)
        elif self.graphs is not None and batch.num_prefill == 0:
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.slots, ids)  # [N, V] or None
        elif self.graphs is not None and ids is None and batch.num_prefill < len(batch.requests):
            logits = self._forward_mixed(batch)  # [N, V] or None
        if logits is None:
            logits = self.forward_eager(batch, ids)
        if recorder is not None:
            recorder.end_step()
        rows = [i for i, s in enumerate(batch.samples) if s]
        step = LaunchedStep(batch, rows, launched_at=launched_at)
        if not rows:  # every row a mid-prompt chunk
            return step
        reqs = [batch.requests[i] for i in rows]
        for req in reqs:
            if req.generator is None and not req.params.greedy:
                req.generator = make_generator(req.params.seed, self.device)
            if req.logit_state is None and req.params.processes_logits:
                req.logit_state = penalties.LogitState.create(req.prompt_token_ids, req.params, logits.shape[1],
                                                              self.eos_token_ids, self.device)
        if len(rows) < logits.shape[0]:
            logits = logits[torch.tensor(rows, dtype=torch.long, device=logits.device)]  # [n, V]
        params = [r.params for r in reqs]
        processed = penalties.apply(logits, params, [r.logit_state for r in reqs])  # [n, V]
        if any(r.grammar is not None for r in reqs):  # computed on the host while the device runs the forward
            if processed is logits:
                processed = logits.clone()  # logprobs read the model's own logits
            self.masks.apply(processed, [r.grammar for r in reqs])
        step.tokens = self.sampler.sample(processed, params, [r.generator for r in reqs])  # [n]
        for j, req in enumerate(reqs):
            if req.logit_state is not None:
                req.logit_state.record(step.tokens[j:j + 1])
        self._launch_logprobs(step, logits, params)
        if self.device.type == "cuda":
            step.host = torch.empty(len(rows), dtype=torch.long, pin_memory=True)
            step.host.copy_(step.tokens, non_blocking=True)
            step.ready = torch.cuda.Event(blocking=True)  # collect(sleep=True) sleeps on it instead of spinning
            step.ready.record()
        return step

    def collect(self, step: "LaunchedStep", sleep: bool = False) -> list[int | None]:
        """Wait for a launched step's tokens: one id per sequence of its batch (None where nothing was sampled).

        ``sleep``: the thread sleeps until they land (a later step is queued behind this one, so waking a
        little late costs nothing, and the core is free for the HTTP side meanwhile); otherwise it spins."""
        out: list[int | None] = [None] * len(step.batch.requests)
        if step.tokens is None:
            return out
        if step.ready is not None and sleep:
            step.ready.synchronize()
        elif step.ready is not None:  # nothing is queued behind this step: the stream's end is its end
            torch.cuda.current_stream(self.device).synchronize()
        for i, tok in zip(step.rows, (step.host if step.host is not None else step.tokens).tolist()):
            out[i] = tok
        return out

    @staticmethod
    def _launch_logprobs(step: "LaunchedStep", logits: torch.Tensor, params: list) -> None:
        """Queue the logprobs of the rows that ask for them (logits [n, V] as the model gave them)."""
        want = [j for j, p in enumerate(params) if p.logprobs is not None]
        if want:
            k = max(params[j].logprobs for j in want)
            idx = torch.tensor(want, dtype=torch.long, device=logits.device)
            step.logprob_rows = want
            step.logprobs = token_logprobs(logits[idx], step.tokens[idx], k)

    def logprobs_of(self, step: "LaunchedStep") -> list[dict | None] | None:
        """After ``collect``: per sequence of the step's batch, the sampled token's logprob and its
        request's ``logprobs`` best alternatives, {"logprob": x, "top": [[id, logprob], ...]}, or None."""
        if step.logprobs is None:
            return None
        out: list[dict | None] = [None] * len(step.batch.requests)
        chosen, top, top_ids = (t.tolist() for t in step.logprobs)
        for n, j in enumerate(step.logprob_rows):
            i = step.rows[j]
            k = step.batch.requests[i].params.logprobs
            out[i] = {"logprob": chosen[n], "top": [[t, lp] for t, lp in zip(top_ids[n][:k], top[n][:k])]}
        return out

    def _forward_mixed(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """logits [N, V] of a step with prompt chunks AND decode rows as two forwards: the chunks eagerly, the
        decode rows by graph replay; None when the backend keeps one forward per step or no graph fits.

        Why: eagerly, every decode row is a sequence of its own in the prefill attention loop (~5 launches
        per row and layer: 16 streams x 24 layers ~ 2000 launches, tens of ms), and each admitted request
        puts all running streams through such a step. Split, the decode rows cost one replay. Backends
        that time their steps (hybrid, auto: ``observe_decode_step``) keep one forward per step, as their
        controllers count a step's tokens together."""
        if hasattr(self.model.backend, "observe_decode_step"):
            return None
        n, T = batch.num_prefill, sum(batch.query_lens[:batch.num_prefill])
        decode = self.graphs.run(batch.input_ids[T:], batch.positions[T:], batch.slots[n:])  # [N - n, V]
        if decode is None:
            return None
        chunks = ScheduledBatch(batch.requests[:n], n, batch.input_ids[:T], batch.positions[:T], batch.slots[:n],
                                batch.start_pos[:n], batch.query_lens[:n])
        return torch.cat([self.forward_eager(chunks), decode])  # copies the replay's static output

    def _forward_invariant(self, batch: ScheduledBatch, ids: torch.Tensor | None) -> torch.Tensor:
        """logits [N, V] of a step computed row for row as in any other batch (module docstring): each
        prompt chunk in an eager forward of its own, the decode rows padded to max_running_requests rows."""
        parts, t = [], 0
        for i in range(batch.num_prefill):
            n = batch.query_lens[i]
            parts.append(self.forward_eager(ScheduledBatch(
                [batch.requests[i]], 1, batch.input_ids[t:t + n], batch.positions[t:t + n], [batch.slots[i]],
                [batch.start_pos[i]], [n])))
            t += n
        if batch.num_prefill < len(batch.requests):
            parts.append(self._decode_padded(batch.input_ids[t:], batch.positions[t:],
                                             batch.slots[batch.num_prefill:], ids))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_padded(self, input_ids: list[int], positions: list[int], slots: list[int],
                       device_ids: torch.Tensor | None) -> torch.Tensor:
        """logits [n, V] of n decode rows computed at max_running_requests rows: the graph of that size, or
        eagerly at that size (same padding, the graphs' static window) when there is no graph."""
        if self.graphs is not None:
            out = self.graphs.run(input_ids, positions, slots, device_ids)
            if out is not None:
                return out
        from services.engine.runtime.kv_cache import ForwardBatch, upload

        n = len(positions)
        ids, pos, slots = pad_decode_rows(input_ids, positions, slots, self.num_slots, self.pad_slot)
        ids = upload(ids, self.device)  # [Bmax], no sync: the previous step may still be running (forward_eager)
        if device_ids is not None:
            ids[:n] = device_ids
        fb = ForwardBatch(slots=slots, start_pos=pos, query_lens=[1] * len(pos), kv_len=self.kv.max_seq_len)
        return self.model(ids, upload(pos, self.device), fb, self.kv)[:n]

    def forward_eager(self, batch: ScheduledBatch, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """logits [N, V] of one eager forward; ``input_ids`` [T] on the device replaces the batch's own."""
        from services.engine.runtime.kv_cache import ForwardBatch, upload

        if input_ids is None:  # no sync: the previous step may still be running on the device
            input_ids = upload(batch.input_ids, self.device)  # [T]
        positions = upload(batch.positions, self.device)  # [T]
        fb = ForwardBatch(slots=batch.slots, start_pos=batch.start_pos, query_lens=batch.query_lens)
        return self.model(input_ids, positions, fb, self.kv)  # [N, V] fp32

    def stats(self) -> dict:
        return {"cuda_graph_sizes": sorted(self.graphs.graphs) if self.graphs else [],
                "triton_compiles_after_start": len(self.compile_watch.compiles)}


@dataclass(eq=False)
class LaunchedStep:
    """A step queued on the device (ModelRunner.launch): its batch, the rows that sample, their tokens on
    the device, and on CUDA a pinned copy of them with the event that says it has landed."""

    batch: ScheduledBatch
    rows: list[int]  # indices into batch.requests of the rows that sample
    tokens: torch.Tensor | None = None  # [len(rows)] int64 on the device; None when nothing samples
    host: torch.Tensor | None = None  # [len(rows)] pinned (CUDA)
    logprob_rows: list[int] = field(default_factory=list)  # indices into rows that asked for logprobs
    logprobs: tuple | None = None  # token_logprobs() of those rows, on the device
    ready: "torch.cuda.Event | None" = None
    launched_at: float = field(default_factory=time.perf_counter)


def pad_decode_rows(input_ids: list[int], positions: list[int], slots: list[int], size: int,
                    pad_slot: int) -> tuple[list[int], list[int], list[int]]:
    """Decode rows' inputs padded to ``size`` rows: token 0 at position 0 of ``pad_slot`` (the KV cache's
    spare slot, which no request owns: a padding row writes and reads nothing else)."""
    pad = size - len(positions)
    return input_ids + [0] * pad, positions + [0] * pad, slots + [pad_slot] * pad


class DecodeGraphs:
    """CUDA graphs of one decode step per padded batch size, sharing one memory pool and one static
    input buffer ``[3, max_batch]`` (token ids, positions, slots) filled by a single H2D copy.
    ``sizes``: the batch sizes captured; default every size (no padding rows, module docstring)."""

    def __init__(self, model, kv, max_batch: int, pad_slot: int, sizes: list[int] | None = None):
        self.model, self.kv = model, kv
        self.max_batch, self.pad_slot = max_batch, pad_slot
        self.sizes = sizes or list(range(1, max_batch + 1))
        self.static = torch.zeros(3, max_batch, dtype=torch.long, device=kv.device)  # [3, Bmax]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # B -> (graph, logits [B, V])
        self._pool = None
        self.check_diffs: dict[int, float] = {}  # B -> the replay check's max |replay - eager| / max |eager|

    def _batch(self, B: int):
        from services.engine.runtime.kv_cache import ForwardBatch

        # kv_len = the whole window: shapes never change between replays (positions mask the rest)
        return ForwardBatch(slots=[self.pad_slot] * B, start_pos=[0] * B, query_lens=[1] * B,
                            kv_len=self.kv.max_seq_len, slot_ids=self.static[2, :B])

    def _reset_inputs(self) -> None:
        self.static[0].fill_(1)
        self.static[1].zero_()
        self.static[2].fill_(self.pad_slot)

    @torch.inference_mode()
    def capture(self, report=None) -> None:
        """Capture every size, largest first (the smaller ones reuse its pool); ``report(done, total)`` after
        each, and a tqdm bar on stderr."""
        t0 = time.perf_counter()
        sizes = sorted(self.sizes, reverse=True)
        for n, B in enumerate(tqdm(sizes, desc="capturing CUDA graphs", unit="graph", leave=False), 1):
            try:
                self._capture_one(B)
            except Exception as exc:  # not capturable (host sync, unsupported op): this size runs eager
                log.warning("decode batch %d: CUDA graph capture failed, eager instead (%s: %s)", B,
                            type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                torch.cuda.synchronize()
            if report is not None:
                report(n, len(sizes))
        got = sorted(self.graphs)
        log.info("CUDA graphs captured in %.1f s for decode batch sizes %s (replay vs eager: max diff %.2g %% of "
                 "the logits)", time.perf_counter() - t0,
                 f"1-{got[-1]}" if got == list(range(1, len(got) + 1)) and got else (got or "none"),
                 100 * max(self.check_diffs.values(), default=0.0))

    def _capture_one(self, B: int) -> None:
        ids, pos, batch = self.static[0, :B], self.static[1, :B], self._batch(B)
        self._reset_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: lazy inits, Triton compiles, allocator
            for _ in range(2):
                self.model(ids, pos, batch, self.kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of other threads (the hybrid split controller's side stream) may go on
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self.model(ids, pos, batch, self.kv)  # [B, V] static output
        self._pool = graph.pool()
        # Check the replay against an eager forward built from plain lists (catches anything frozen at
        # capture time, e.g. a slot list read on the host): rows in real slots 0..B-1 at position 0
        # (nothing is running yet), distinct tokens.
        from services.engine.runtime.kv_cache import ForwardBatch

        self.static[0, :B].copy_(torch.arange(3, 3 + B))
        self.static[1, :B].zero_()
        self.static[2, :B].copy_(torch.arange(B))
        # hybrid: both checked passes must split alike (``same_split``: no fetch while held), or one computes
        # on the CPU what the other computes on the GPU. A replay before, at the real split, fetches some of
        # these tokens' experts, so the checked passes compute on both sides.
        same_split = getattr(self.model.backend, "same_split", None)
        if same_split is not None:
            graph.replay()
        with same_split() if same_split is not None else contextlib.nullcontext():
            graph.replay()
            replayed = out.clone()
            eager = self.model(self.static[0, :B].clone(), self.static[1, :B].clone(),
                               ForwardBatch(slots=list(range(B)), start_pos=[0] * B, query_lens=[1] * B), self.kv)
        # Loose on purpose: bf16 kernels over a longer masked window may round differently, and a model whose
        # logits are sensitive amplifies that; a frozen decision (wrong slot, wrong expert) moves logits by
        # their own magnitude.
        diff, scale = (replayed - eager).abs().max().item(), eager.abs().max().item()
        self.check_diffs[B] = diff / max(scale, 1e-30)
        if not diff <= 0.05 * scale + 1e-3:
            raise RuntimeError(f"replay differs from eager: max abs diff {diff:.3g} (logits up to {scale:.3g})")
        self.graphs[B] = (graph, out)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int],
            device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """logits [N, V] of a decode step by graph replay, or None when no captured size fits N.
        ``device_ids`` [N] on the device, when given, are the token ids (``input_ids`` is ignored).

        Returns without waiting for the GPU: the inputs go up from pinned memory (a copy from pageable
        memory may wait for the work queued before it, i.e. for the step still running)."""
        n = len(positions)
        B = next((b for b in sorted(self.graphs) if b >= n), None)
        if B is None:
            return None
        ids = [0] * n if device_ids is not None else input_ids
        host = torch.tensor(pad_decode_rows(ids, positions, slots, B, self.pad_slot), dtype=torch.long)  # [3, B]
        if self.static.is_cuda:
            host = host.pin_memory()
        self.static[:, :B].copy_(host, non_blocking=True)
        if device_ids is not None:
            self.static[0, :n].copy_(device_ids)
        graph, out = self.graphs[B]
        graph.replay()
        return out[:n]

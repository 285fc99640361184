"""Count the device ops (~ CUDA kernels) of one bs=1 decode step, or of one eager prefill / mixed step
(``--mixed ROWS,PROMPTS,LEN``), per decoder layer, on the CPU.

    python -m benchmarks.count_decode_ops [--model synthetic:tiny] [--dtype bfloat16] [--kv-len 64] [--json PATH]
    python -m benchmarks.count_decode_ops --model 'synthetic:tiny?layers=24' --mixed 16,4,60

Why: under CUDA-graph replay each kernel still costs a few us, so on a 48-layer model the number of
kernels per layer, not the bytes, decides decode speed. This runs one decode step the way the
CUDA-graph runner drives it (static KV window ``kv_len``, slot tensor given) under a
``TorchDispatchMode`` that records every aten op reaching a backend kernel, attributed to the decoder
layer it ran in. View/alias ops and allocations launch no kernel and are listed apart ("free").
The MoE experts take the decode path the GPU takes (``resident.moe_decode``: Triton GEMV under
TRITON_INTERPRET here); each Triton launch counts as one op ``triton::<kernel>``. Host syncs
(``aten::_local_scalar_dense``, ``aten::nonzero``, ...) are counted apart: they break CUDA graphs.
Python-level reads of tensor values (``.item()``, ``.tolist()``, ``bool``/``int``/``float`` of a tensor,
``.cpu()``, ``.numpy()``, ``torch.nonzero``/``unique``) and ``torch.tensor`` built from host values (a
pageable host->device copy on CUDA, which waits for the stream) are tabled apart again (``HOST_CALLS``,
``OpCounter.host``): on the CPU most of them reach no aten op, and on CUDA each one in a layer stalls the
host once per layer (tests/benchmarks/test_prefill_host_syncs.py keeps the layers free of them).

Sizes do not change the counts, so the default is the tiny Qwen3-MoE preset in bf16 (bf16 keeps the
dtype casts that an fp32 run would skip).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections import Counter

import torch

if not torch.cuda.is_available():  # before kernels.* define their @triton.jit functions
    os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

FREE = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "detach",
        "alias", "_reshape_alias", "set_"}  # launch no kernel (allocation, metadata)
SYNCS = {"_local_scalar_dense", "nonzero", "item", "_assert_async", "masked_select", "unique",
         "_unique2", "bincount", "repeat_interleave"}  # copy a device value to the host


# Tensor methods / torch functions that read device values on the host (or copy host values up), counted by
# ``counted_host_calls`` as "host::<name>" into OpCounter.host.
HOST_METHODS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy")
HOST_FUNCTIONS = ("nonzero", "unique", "tensor")
HOST_CALLS = {f"host::{name}" for name in HOST_METHODS + HOST_FUNCTIONS}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (by short name) into ``self.counts[label]``; ``label`` is set by module hooks.
    ``paused`` while a Triton kernel runs under the interpreter (its tensor traffic is not the host path's)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = "outside layers"
        self.counts: dict[str, Counter] = {}
        self.free: dict[str, Counter] = {}
        self.host: dict[str, Counter] = {}  # HOST_CALLS by label
        self.paused = False

    def record(self, name: str, free: bool = False) -> None:
        table = self.free if free else self.counts
        table.setdefault(self.label, Counter())[name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        free = name in FREE
        if func.is_view:  # aliasing schema; but e.g. aten::to with a new dtype copies
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            free = (first is not None and isinstance(out, torch.Tensor)
                    and out.untyped_storage().data_ptr() == first.untyped_storage().data_ptr())
        self.record(name, free=free)
        return out


class _Launch:
    """A counted @triton.jit function: ``fn[grid](...)`` records one op, then launches with the counter off."""

    def __init__(self, fn, counter: OpCounter) -> None:
        self.fn, self.counter = fn, counter

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.counter.record(f"triton::{self.fn.__name__}")
            self.counter.paused = True
            try:
                with _disable_current_modes():
                    return self.fn[grid](*args, **kwargs)
            finally:
                self.counter.paused = False
        return run

    def __call__(self, *args, **kwargs):  # a @triton.jit helper called from inside another kernel
        return self.fn(*args, **kwargs)


KERNEL_MODULES = ("moe_gemv", "moe_gemm", "rmsnorm", "qk_norm_rope", "route_topk", "decode_attention", "paged_prefill_attention",
                  "gemv")


@contextlib.contextmanager
def triton_path(triton: bool):
    """The fused ops on their Triton kernels as on CUDA (``triton``) or on the CPU's torch path, for the
    block only: ``fused.FORCE`` is process-wide, and a count must not leave it set for whatever runs next
    in the process (the test suite's later bf16 parity tests would run on the interpreter)."""
    from services.engine.models import fused

    old, fused.FORCE = fused.FORCE, triton
    try:
        yield
    finally:
        fused.FORCE = old


@contextlib.contextmanager
def counted_launches(counter: OpCounter):
    """Every @triton.jit function of the kernel modules replaced, for the block, by a proxy that counts one
    op per launch into ``counter`` and runs the real kernel with the counter switched off (the
    interpreter's own tensor traffic is not device work)."""
    import importlib

    import triton
    from triton.runtime.interpreter import InterpretedFunction

    replaced = []
    for module in (importlib.import_module(f"kernels.{name}") for name in KERNEL_MODULES):
        for name, obj in list(vars(module).items()):
            if isinstance(obj, (triton.runtime.JITFunction, InterpretedFunction)):
                setattr(module, name, _Launch(obj, counter))
                replaced.append((module, name, obj))
    try:
        yield
    finally:
        for module, name, obj in replaced:
            setattr(module, name, obj)


@contextlib.contextmanager
def counted_host_calls(counter: OpCounter):
    """Every HOST_METHODS method of torch.Tensor and HOST_FUNCTIONS function of torch wrapped, for the block,
    to record "host::<name>" into ``counter.host[counter.label]`` (not while a Triton launch is running)."""

    def wrap(name: str, original):
        def counted(*args, **kwargs):
            if not counter.paused:
                counter.host.setdefault(counter.label, Counter())[f"host::{name}"] += 1
            return original(*args, **kwargs)
        return counted

    saved = []
    for owner, names in ((torch.Tensor, HOST_METHODS), (torch, HOST_FUNCTIONS)):
        for name in names:
            saved.append((owner, name, owner.__dict__.get(name)))  # None: inherited (TensorBase)
            setattr(owner, name, wrap(name, getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, original in saved:
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def count_decode_step(model: str, dtype: torch.dtype, kv_len: int, start: int = 5, triton: bool = True) -> OpCounter:
    """One decode step (slot 0, position ``start``, KV window ``kv_len``) of ``model`` on the CPU, counted.
    ``triton``: the fused ops take their Triton kernels as on CUDA (else the torch path of the CPU)."""
    from services.engine.config import EngineConfig, MoEBackend
    from services.engine.models.registry import load_model
    from services.engine.moe.resident import moe_decode
    from services.engine.runtime.kv_cache import ForwardBatch, KVCache

    cfg = EngineConfig(model=model, device="cpu", dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                       moe_backend=MoEBackend.RESIDENT, max_seq_len=kv_len)
    lm = load_model(cfg)
    backend = lm.model.backend
    if backend is not None:  # the GPU decode path (on the CPU resident would take the grouped path)
        backend.forward = lambda layer, h, ids, w: moe_decode(h, ids, w, **backend.layers[layer])
    kv = KVCache(lm.spec, 1, kv_len, "cpu", dtype)
    prompt = torch.arange(1, start + 1)
    lm.model(prompt, torch.arange(start), ForwardBatch.single(0, 0, start), kv)  # prefill (not counted)
    ids, pos = torch.tensor([7]), torch.tensor([start])
    batch = ForwardBatch(slots=[0], start_pos=[start], query_lens=[1], kv_len=kv_len,
                         slot_ids=torch.zeros(1, dtype=torch.long))
    return _count_forward(lm, ids, pos, batch, kv, triton)


def count_mixed_step(model: str, dtype: torch.dtype, decode_rows: int, prompts: int, prompt_len: int,
                     triton: bool = True, decode_start: int = 100) -> OpCounter:
    """One eager step of ``prompts`` new prompts of ``prompt_len`` tokens (fresh slots, position 0) and
    ``decode_rows`` decode rows (one token each at position ``decode_start``), counted. The resident
    runner replays the decode rows apart (``decode_rows=0`` counts its eager part); hybrid and auto run
    the whole step as this one eager forward."""
    from services.engine.config import EngineConfig, MoEBackend
    from services.engine.models.registry import load_model
    from services.engine.moe.resident import moe_decode
    from services.engine.runtime.kv_cache import ForwardBatch, KVCache

    max_len = max(decode_start + 1, prompt_len)
    cfg = EngineConfig(model=model, device="cpu", dtype="bfloat16" if dtype == torch.bfloat16 else "float32",
                       moe_backend=MoEBackend.RESIDENT, max_seq_len=max_len)
    lm = load_model(cfg)
    backend = lm.model.backend
    if backend is not None:  # the GPU path (on the CPU resident would take the grouped path)
        backend.forward = lambda layer, h, ids, w: moe_decode(h, ids, w, **backend.layers[layer])
    S = decode_rows + prompts
    kv = KVCache(lm.spec, S, max_len, "cpu", dtype)
    gen = torch.Generator().manual_seed(0)
    vocab = lm.spec.vocab_size
    lens = [prompt_len] * prompts + [1] * decode_rows
    starts = [0] * prompts + [decode_start] * decode_rows
    ids = torch.randint(1, vocab, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    batch = ForwardBatch(slots=list(range(S)), start_pos=starts, query_lens=lens)
    return _count_forward(lm, ids, pos, batch, kv, triton)


def _count_forward(lm, ids, pos, batch, kv, triton: bool) -> OpCounter:
    """One forward of ``lm`` counted by layer, after an uncounted one (lazy inits: fused weights, Triton
    compiles), with the fused ops on Triton (``triton``) or the CPU's torch path for these two only."""
    counter = OpCounter()
    with triton_path(triton):
        lm.model(ids, pos, dataclasses.replace(batch, _packed={}), kv)
        handles = _label_layers(lm, counter)
        try:  # a fresh batch, as every served step has: its per-step tables are built in the counted forward
            with counted_launches(counter), counted_host_calls(counter), counter:
                lm.model(ids, pos, dataclasses.replace(batch, _packed={}), kv)
        finally:
            for h in handles:
                h.remove()
    counter.spec = lm.spec
    return counter


def _label_layers(lm, counter: OpCounter) -> list:
    def enter(i):
        def hook(module, args):
            counter.label = f"layer {i}"
        return hook

    def leave(module, args, out):
        counter.label = "outside layers"

    handles = []
    for i, layer in enumerate(lm.model.model.layers):
        handles += [layer.register_forward_pre_hook(enter(i)), layer.register_forward_hook(leave)]
    return handles


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="count_decode_ops", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="synthetic:tiny")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--kv-len", type=int, default=64, help="static decode KV window (as the graph runner)")
    p.add_argument("--torch-path", action="store_true",
                   help="count the torch path of the fused ops (what the CPU runs) instead of their Triton kernels")
    p.add_argument("--mixed", metavar="ROWS,PROMPTS,LEN",
                   help="count an eager step of PROMPTS new prompts of LEN tokens and ROWS decode rows instead "
                        "(e.g. 16,4,60 as hybrid runs it; 0,4,60 is resident's eager part, its decode rows replay)")
    p.add_argument("--json", help="also write the counts to this JSON file")
    args = p.parse_args(argv)
    if args.mixed:
        try:
            rows, prompts, length = (int(x) for x in args.mixed.split(","))
            if rows < 0 or prompts < 0 or length <= 0 or rows + prompts == 0:
                raise ValueError
        except ValueError:
            p.error(f"--mixed wants ROWS,PROMPTS,LEN (non-negative, LEN > 0, a row or a prompt), got {args.mixed!r}")
        counter = count_mixed_step(args.model, getattr(torch, args.dtype), rows, prompts, length,
                                   triton=not args.torch_path)
        step = f"mixed step: {prompts} prompts x {length} tokens + {rows} decode rows"
    else:
        counter = count_decode_step(args.model, getattr(torch, args.dtype), args.kv_len, triton=not args.torch_path)
        step = f"decode bs=1, KV window {args.kv_len}"
    from services.engine.models import fused
    if fused._broken:
        print(f"count_decode_ops: Triton kernels failed: {sorted(fused._broken)}", file=sys.stderr)
        return 1
    spec = counter.spec
    kernels = {label: sum(c.values()) for label, c in counter.counts.items()}
    path = "torch path" if args.torch_path else "Triton kernels as on CUDA"
    print(f"{args.model} ({args.dtype}, {step}, {path}): device ops (~kernels) per step")
    shown = set()
    for i in range(spec.num_layers):
        label = f"layer {i}"
        c = counter.counts.get(label, Counter())
        kind = "moe" if spec.moe_ordinal(i) is not None else "dense"
        key = (kind, tuple(sorted(c.items())))
        if key in shown:
            continue  # identical to a layer already printed
        shown.add(key)
        free = sum(counter.free.get(label, Counter()).values())
        print(f"\n{label} ({kind}): {kernels.get(label, 0)} ops (+{free} free views/allocs)")
        for name, n in sorted(c.items(), key=lambda kv: (-kv[1], kv[0])):
            sync = "  <- host sync" if name in SYNCS else ""
            print(f"  {n:4d}  {name}{sync}")
    outside = counter.counts.get("outside layers", Counter())
    print(f"\noutside layers (embedding, rope, final norm, head): {sum(outside.values())} ops")
    for name, n in sorted(outside.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {n:4d}  {name}")
    total = sum(kernels.values())
    syncs = sum(n for c in counter.counts.values() for name, n in c.items() if name in SYNCS)
    print(f"\ntotal {total} ops per step, {syncs} host syncs")
    for label, c in counter.host.items():
        print(f"host reads / host->device tensors, {label}: " + ", ".join(f"{n} {name}" for name, n in sorted(c.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "dtype": args.dtype, "kv_len": args.kv_len, "mixed": args.mixed, "total": total,
                       "host_syncs": syncs, "host_calls": {k: dict(v) for k, v in counter.host.items()},
                       "ops": {k: dict(v) for k, v in counter.counts.items()},
                       "free": {k: dict(v) for k, v in counter.free.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HybridBackend.same_split, what the runner's replay check holds (runtime/runner.py DecodeGraphs): two passes
over the same inputs split alike and give the same output. Without it the second pass finds the first's
fetches as hits and computes on the "GPU" (here torch, on the CPU) what the first computed in the CPU
executor: bf16 gpt-oss experts then round differently, which on synthetic gpt-oss-120b moved the logits by
18 % of their largest value and failed the H200's decode graph capture."""

import os

import torch

if not torch.cuda.is_available():  # before any Triton kernel is defined (see tests/kernels/conftest.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from services.engine.config import EngineConfig, MoEBackend  # noqa: E402
from services.engine.moe.backends import BackendContext  # noqa: E402
from services.engine.moe.hybrid import HybridBackend  # noqa: E402
from tests.engine.moe.test_cpu_executor_mxfp4 import mxfp4_case  # noqa: E402

T, A, E, D, I = 1, 4, 16, 96, 64  # one decode token of a gpt-oss-like layer: top-4, clamped SwiGLU, biases


def two_passes(hold: bool):
    banks, hidden, _, _ = mxfp4_case(T, A, E, D, I, seed=4, gpt_oss=True, dtype=torch.bfloat16)
    hidden = hidden.bfloat16()
    ids = torch.tensor([[1, 5, 9, 13]])  # [T, A]: four misses in an empty cache
    w = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    cfg = EngineConfig(model="synthetic:tiny", moe_backend="hybrid")
    ctx = BackendContext(banks, cfg, torch.device("cpu"), torch.bfloat16, A, 0)
    backend = HybridBackend(ctx, MoEBackend.HYBRID, num_slots=2 * A, count_routes=True)
    outs, routes = [], []
    f0 = backend.buckets.f_q16.clone()
    try:
        for _ in range(2):
            before = dict(backend.routes)
            if hold:
                with backend.same_split():
                    outs.append(backend.forward(0, hidden, ids, w))
            else:
                outs.append(backend.forward(0, hidden, ids, w))
            routes.append({k: backend.routes[k] - before[k] for k in before})
        f = [s.q16 for s in backend.buckets.states], backend.buckets.f_q16.tolist(), f0
    finally:
        backend.close()
    return outs, routes, f


def test_without_it_the_second_pass_splits_otherwise_and_rounds_otherwise():
    outs, routes, _ = two_passes(hold=False)
    assert routes[0]["cpu"] > 0 and routes[1]["gpu"] > routes[0]["gpu"]  # the first pass's fetches are hits
    assert not torch.equal(outs[0], outs[1])  # same maths, other rounding


def test_held_both_passes_split_alike_and_agree_bit_for_bit():
    outs, routes, f = two_passes(hold=True)
    assert routes[0] == routes[1] == {"gpu": 0, "cpu": T * A}  # nothing fetched: every miss on the CPU
    assert torch.equal(outs[0], outs[1])
    current, published, before = f
    assert current == published and max(published) > 0 and int(before.max()) > 0  # published again after the hold

"""The cache kernels launch one specialization for every step size: ``ensure_experts`` (offload, and the
prefill path of hybrid) and ``ensure_experts_hybrid``'s split read routes in a fixed block (ROUTES_BLOCK),
and their route count N and layer are not specialized, so a prompt of a new length compiles nothing.

Why a test of its own: test_warm_covers_requests.py runs an offload engine on the Triton cache kernels, but
a hybrid engine on the CPU splits only where its controller's fraction is below 1 (it backs off to offload
otherwise; the GPU's graph mode splits every step up to the 256-token cap), which the CPU's traffic does not
reach at prompt sizes; here the launchers are called directly at T = 1, 3, 17 and 200 (T x top-8 routes
below, at and far above one block) and every launch's key is recorded as in that test."""

from __future__ import annotations

import pytest
import torch

from kernels.ensure_experts_ref import CacheState
from services.engine.moe.split import fraction_to_q16
from tests.kernels.test_warm_covers_requests import LaunchKeys

E, A, S, L = 128, 8, 32, 2  # Qwen3-30B-A3B's routing: 128 experts, top-8
STEP_TOKENS = (1, 3, 17, 200)


def routes(T: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=gen)[:A] for _ in range(T)])  # [T, A] distinct per token


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's launches")
@pytest.mark.parametrize("split", [False, True], ids=["ensure", "split"])
def test_one_kernel_specialization_for_every_step_size(monkeypatch, split):
    from kernels.ensure_experts import ensure_experts
    from kernels.ensure_experts_hybrid import ensure_experts_hybrid

    recorder = LaunchKeys()
    recorder.install(monkeypatch)
    state = CacheState.allocate(L, E, S, torch.device("cpu"))
    f_q16 = torch.tensor([fraction_to_q16(0.5)], dtype=torch.int32)
    for i, T in enumerate(STEP_TOKENS):
        for layer in range(L):
            ids = routes(T, seed=i * L + layer)
            if split:
                ensure_experts_hybrid(state, layer, ids, f_q16)
            else:
                for chunk in range(-(-min(E, T * A) // min(E, S))):  # every chunk, as the offload backend does
                    ensure_experts(state, layer, ids, chunk=chunk)
    name = "_split_misses_kernel" if split else "_ensure_experts_kernel"
    keys = {k for k in recorder.keys if k[0].rsplit(".", 1)[-1] == name}
    assert len(keys) == 1, f"{name}: {len(keys)} specializations for T in {STEP_TOKENS}:\n" + "\n".join(map(str, keys))

"""Helpers shared by the tests (one copy, not one per test file)."""

from __future__ import annotations

import asyncio
import threading
from contextlib import asynccontextmanager, contextmanager

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.registry import build_backend, load_model
from services.engine.runtime.kv_cache import ForwardBatch, KVCache


# Tests that play the device on the CPU (Triton's interpreter on CPU tensors, a stand-in driver): with CUDA the
# interpreter is off, the kernels would be handed CPU tensors, and the gpu-marked tests run the real thing.
CPU_PLAYS_THE_DEVICE = pytest.mark.skipif(torch.cuda.is_available(), reason="plays the device on the CPU; "
                                          "with CUDA the gpu tests run the real kernels")


@asynccontextmanager
async def model_thread_held(engine):
    """Hold ``engine``'s model thread while the body submits requests, so they all arrive before its next
    step (admitted together, as far as the slots allow)."""
    gate = threading.Event()
    blocker = asyncio.ensure_future(engine.call(lambda: gate.wait(10)))
    await asyncio.sleep(0.1)
    try:
        yield
    finally:
        gate.set()
        await blocker


def tolerance(dtype: torch.dtype) -> float:
    """Max abs difference accepted between two implementations (fp32 ~1e-5, bf16 ~2e-2)."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def greedy_generate(loaded, prompt_ids: list[int], n: int, slot: int = 0) -> list[int]:
    """``n`` greedy tokens after ``prompt_ids`` with the engine's own forward + KVCache (one prefill
    step, then one decode step per token). Compare backends by calling this on each."""
    kv = KVCache(loaded.spec, slot + 1, len(prompt_ids) + n, loaded.device, loaded.dtype)
    ids = torch.tensor(prompt_ids, dtype=torch.long, device=loaded.device)
    positions = torch.arange(len(prompt_ids), device=loaded.device)
    logits = loaded.model(ids, positions, ForwardBatch.single(slot, 0, len(prompt_ids)), kv)  # [1, V]
    out: list[int] = []
    for step in range(n):
        token = int(logits[0].argmax())
        out.append(token)
        if step == n - 1:
            break
        pos = len(prompt_ids) + step
        logits = loaded.model(torch.tensor([token], device=loaded.device), torch.tensor([pos], device=loaded.device),
                              ForwardBatch.single(slot, pos, 1), kv)
    return out


def graph_greedy(loaded, backend_name: str, prompt_ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens as the server makes them on CUDA: an eager prefill, then the decode steps replayed
    from the ModelRunner's captured bs=1 graph (asserted captured). Compare with ``greedy_generate``."""
    from services.engine.runtime.runner import ModelRunner

    runner = ModelRunner(loaded, 1, max(128, len(prompt_ids) + n), loaded.device, loaded.dtype, backend_name=backend_name)
    assert runner.graphs is not None and 1 in runner.graphs.graphs, "no decode graph was captured for bs=1"
    ids = torch.tensor(prompt_ids, device=loaded.device)
    logits = loaded.model(ids, torch.arange(len(prompt_ids), device=loaded.device),
                          ForwardBatch(slots=[0], start_pos=[0], query_lens=[len(prompt_ids)]), runner.kv)
    tokens, pos = [int(logits[0].argmax())], len(prompt_ids)
    while len(tokens) < n:
        tokens.append(int(runner.graphs.run([tokens[-1]], [pos], [0])[0].argmax()))
        pos += 1
    return tokens


def on_cuda_with_resident_tokens(model_dir: str, prompt_ids: list[int], n: int):
    """The checkpoint in ``model_dir`` loaded on CUDA (the test skips without it) with the resident backend
    attached, and resident's ``n`` greedy tokens: the reference a CUDA backend must reproduce."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loaded = load_model(EngineConfig(model=model_dir, device="cuda"), attach_backend=False)
    loaded.model.set_backend(build_backend(loaded, EngineConfig(model=model_dir, device="cuda")))
    return loaded, greedy_generate(loaded, prompt_ids, n)


def resident_greedy(loaded: dict, hf_checkpoints: dict, prompts: dict[str, list[int]], n: int) -> dict[str, dict[str, list[int]]]:
    """{arch: {prompt name: n greedy tokens}} with the `resident` backend attached to each model of
    ``loaded``: the reference the offloading backends must reproduce token for token."""
    out = {}
    for name, lm in loaded.items():
        lm.model.set_backend(build_backend(lm, EngineConfig(model=str(hf_checkpoints[name].dir))))
        out[name] = {key: greedy_generate(lm, prompt, n) for key, prompt in prompts.items()}
    return out


def hf_greedy(hf_model, prompt_ids: list[int], n: int) -> list[int]:
    """Reference greedy continuation with a transformers model (full recompute each step: no cache
    code shared with anything under test)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = hf_model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def hf_last_logits(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """[V] fp32 logits of transformers at the last prompt position."""
    with torch.no_grad():
        return hf_model(torch.tensor([prompt_ids])).logits[0, -1].float()


@contextmanager
def tokens_against_resident(loaded, model_dir: str, prompt_ids: list[int], n: int, **config):
    """Yields (resident's ``n`` greedy tokens, the tokens of a backend built from
    ``EngineConfig(model=model_dir, **config)``, that backend) with the backend attached to ``loaded``;
    the caller asserts on them, the backend is closed on exit."""
    loaded.model.set_backend(build_backend(loaded, EngineConfig(model=model_dir)))
    want = greedy_generate(loaded, prompt_ids, n)
    backend = build_backend(loaded, EngineConfig(model=model_dir, **config))
    loaded.model.set_backend(backend)
    try:
        yield want, greedy_generate(loaded, prompt_ids, n), backend
    finally:
        getattr(backend, "close", lambda: None)()

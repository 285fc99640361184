"""The whole model with its fused Triton ops (RMSNorm + residual, q/k norm + rope, router top-k, one-row GEMVs; under
TRITON_INTERPRET here) against the torch path the parity tests check: prefill and decode logits, and
the static decode step a CUDA-graph runner drives, on the tiny synthetic Qwen3-MoE (per-head q/k norm) and
a tiny gpt-oss (attention sinks, a sliding window shorter than the prompt, q/k/v/o biases, expert biases
and the clamped SwiGLU: on CUDA the Triton GEMV with the gpt-oss expert math, inside the graph too)."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models import fused
from services.engine.models import synthetic
from services.engine.models.registry import load_model
from services.engine.runtime.kv_cache import ForwardBatch, KVCache
from tests.kernels.conftest import kernel_device

PROMPT = [3, 17, 42, 5, 99, 64, 8]
# gpt-oss at the tiny preset's width: layer 0 slides over 4 keys (the prompt is 7), layer 1 attends to all
TINY_GPT_OSS = dict(synthetic.PRESETS["gpt-oss-20b"], num_hidden_layers=2, num_local_experts=8, hidden_size=64,
                    intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    vocab_size=None, sliding_window=4)
MODELS = ["synthetic:tiny", "synthetic:gpt-oss-tiny"]


@pytest.fixture(autouse=True)
def _tiny_gpt_oss(monkeypatch):
    monkeypatch.setitem(synthetic.PRESETS, "gpt-oss-tiny", TINY_GPT_OSS)


def _run(lm, force: bool, kv_len: int | None) -> list[torch.Tensor]:
    """Prefill PROMPT in slot 1 then 4 greedy decode steps; returns each step's logits [1, V]."""
    old, fused.FORCE = fused.FORCE, force
    try:
        dev = lm.device
        kv = KVCache(lm.spec, 2, 32, dev, lm.dtype)
        out = [lm.model(torch.tensor(PROMPT, device=dev), torch.arange(len(PROMPT), device=dev),
                        ForwardBatch.single(1, 0, len(PROMPT)), kv)]
        for step in range(4):
            pos = len(PROMPT) + step
            batch = ForwardBatch(slots=[1], start_pos=[pos], query_lens=[1], kv_len=kv_len)
            out.append(lm.model(out[-1].argmax(-1), torch.tensor([pos], device=dev), batch, kv))
        return out
    finally:
        fused.FORCE = old


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kv_len", [None, 32])
def test_fused_ops_match_torch_path(kv_len, model):
    lm = load_model(EngineConfig(model=model, device=kernel_device().type))
    fused._broken.clear()
    got = _run(lm, True, kv_len)
    assert not fused._broken, f"fused kernels fell back to torch: {fused._broken}"
    ref = _run(lm, False, kv_len)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_step_captured_in_cuda_graph(dtype, model):
    """The fused decode step (all Triton kernels, static inputs as the runner drives them) captured in a
    CUDA graph: replays give the logits of eager steps on an identical cache."""
    lm = load_model(EngineConfig(model=model, device="cuda", dtype=dtype))
    dev, M = torch.device("cuda"), 32
    kv, kv_eager = (KVCache(lm.spec, 2, M, dev, lm.dtype) for _ in range(2))
    for cache in (kv, kv_eager):
        lm.model(torch.tensor(PROMPT, device=dev), torch.arange(len(PROMPT), device=dev),
                 ForwardBatch.single(1, 0, len(PROMPT)), cache)
    ids = torch.tensor([5], device=dev)
    pos = torch.tensor([len(PROMPT)], device=dev)
    batch = ForwardBatch(slots=[1], start_pos=[len(PROMPT)], query_lens=[1], kv_len=M,
                         slot_ids=torch.ones(1, dtype=torch.long, device=dev))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (Triton compiles) on a throwaway cache
        lm.model(ids, pos, batch, KVCache(lm.spec, 2, M, dev, lm.dtype))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lm.model(ids, pos, batch, kv)
    assert not fused._broken
    token = 5
    for step in range(4):
        ids.fill_(token)
        pos.fill_(len(PROMPT) + step)
        graph.replay()
        eager = lm.model(torch.tensor([token], device=dev), torch.tensor([len(PROMPT) + step], device=dev),
                         ForwardBatch.single(1, len(PROMPT) + step, 1), kv_eager)
        tol = 1e-4 if dtype == "float32" else 0.05 * eager.abs().max().item()
        torch.testing.assert_close(out, eager, atol=tol, rtol=0)
        token = int(eager.argmax())

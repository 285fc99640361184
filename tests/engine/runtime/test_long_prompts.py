"""Long prompts through the whole engine on the CPU (the paged KV cache, chunked prefill, preemption, memory
bounds): every backend gives transformers' greedy tokens on a 2k-token prompt prefilled in chunks; a KV pool
too small for all running requests preempts and recomputes, and every stream is still exact; an
out-of-memory in a prompt's step fails that request alone, with the reason, and frees its blocks; and a
16k-token prompt is served in memory that grows with T, not T x T."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import pytest
import torch
from prometheus_client import REGISTRY

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models.loader import read_spec
from services.engine.runtime.kv_cache import KVCache
from services.engine.runtime.sampler import SamplingParams
from tests.helpers import hf_greedy


def serve(ckpt, **cfg) -> Engine:
    engine = Engine(EngineConfig(model=str(ckpt.dir), device="cpu", **cfg))
    engine.start()
    engine.wait_ready(120)
    return engine


async def generate(engine: Engine, rid: str, prompt: list[int], n: int) -> tuple[list[int], dict]:
    tokens, last = [], None
    async for out in engine.submit(rid, prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)):
        tokens += out["token_ids"]
        last = out
    return tokens, last


def prompt_of(n: int, seed: int, vocab: int = 128) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("backend", ["resident", "offload", "cpu", "hybrid", "auto"])
def test_a_2k_token_prompt_in_chunks_gives_transformers_tokens(hf_checkpoints, backend):
    ckpt = hf_checkpoints["qwen3_moe"]
    extra = {} if backend == "resident" else {"moe_cache_rate": 0.25}
    engine = serve(ckpt, moe_backend=backend, max_prefill_tokens=700, **extra)  # 3 chunks, a ragged last one
    try:
        prompt = prompt_of(2048, seed=1)
        tokens, last = asyncio.run(generate(engine, "long", prompt, 6))
        assert tokens == hf_greedy(ckpt.hf, prompt, 6)
        assert last["prompt_tokens"] == 2048 and last["finish_reason"] == "length"
    finally:
        engine.shutdown()


def test_a_pool_too_small_for_every_request_preempts_and_every_stream_stays_exact(hf_checkpoints):
    ckpt = hf_checkpoints["qwen3_moe"]
    per_token = KVCache.nbytes_per_token(read_spec(ckpt.dir), torch.float32)
    pool_tokens = 112  # 7 blocks: three requests of 30 + 40 tokens need 15
    engine = serve(ckpt, max_seq_len=96, kv_cache_memory=(pool_tokens + 8) * per_token / 2 ** 30,
                   max_running_requests=3)
    try:
        prompts = [prompt_of(30, seed=10 + i) for i in range(3)]

        async def all_three():
            return await asyncio.gather(*(generate(engine, f"r{i}", p, 40) for i, p in enumerate(prompts)))

        results = asyncio.run(all_three())
        for prompt, (tokens, _) in zip(prompts, results):
            assert tokens == hf_greedy(ckpt.hf, prompt, 40)
        stats = asyncio.run(engine.stats())
        assert stats["preemptions"] > 0 and stats["kv_blocks_total"] == 7 and stats["kv_blocks_used"] == 0
        assert stats["kv_cache"]["tokens"] == pool_tokens and "--kv-cache-memory" in stats["kv_cache"]["how"]
        exported = REGISTRY.get_sample_value("tandem_num_preemptions_total", {"model_name": engine.loaded.model_id})
        assert exported is not None and exported >= stats["preemptions"]  # the metric: this engine's and earlier ones'
        assert REGISTRY.get_sample_value("tandem_kv_cache_usage_ratio", {"model_name": engine.loaded.model_id}) == 0
    finally:
        engine.shutdown()


def test_an_out_of_memory_fails_only_the_prompts_request_and_frees_its_blocks(hf_checkpoints):
    ckpt = hf_checkpoints["qwen3_moe"]
    engine = serve(ckpt, max_running_requests=2)
    real_launch = engine.runner.launch

    def launch(batch, after=None):  # the step that carries "big"'s prompt runs out of memory
        if any(r.request_id == "big" for r in batch.requests[:batch.num_prefill]):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 35.00 GiB")
        return real_launch(batch, after)

    engine.runner.launch = launch
    try:
        short = prompt_of(20, seed=3)

        async def both():
            first = asyncio.ensure_future(generate(engine, "short", short, 30))
            while (await engine.stats())["running"] == 0:  # "short" is decoding when "big" arrives
                await asyncio.sleep(0.01)
            return await asyncio.gather(first, generate(engine, "big", prompt_of(600, seed=4), 5))

        (short_tokens, _), (big_tokens, big_last) = asyncio.run(both())
        assert big_tokens == [] and big_last["finish_reason"] == "abort"
        assert "out of GPU memory" in big_last["error"] and "--max-prefill-tokens" in big_last["error"]
        assert short_tokens == hf_greedy(ckpt.hf, short, 30)  # the decoding request never noticed
        stats = asyncio.run(engine.stats())
        assert stats["kv_blocks_used"] == 0 and stats["running"] == 0
    finally:
        engine.shutdown()


def test_a_16k_token_prompt_is_served_in_memory_linear_in_its_length(tmp_path):
    """In a fresh process (its peak RSS is the measurement): a 16k-token prompt on a tiny model. T x T scores
    of one layer's 4 heads in fp32 would be 4 GiB; the engine must stay far below."""
    script = textwrap.dedent("""
        import asyncio, json, resource, sys
        import torch
        from services.engine.config import EngineConfig
        from services.engine.engine import Engine
        from services.engine.runtime.sampler import SamplingParams

        engine = Engine(EngineConfig(model="synthetic:tiny", device="cpu", max_seq_len=16400, max_running_requests=2))
        engine.start()
        engine.wait_ready(300)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        prompt = torch.randint(3, 100, (16000,), generator=torch.Generator().manual_seed(0)).tolist()

        async def run():
            out = []
            async for o in engine.submit("x", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)):
                out.append(o)
            return out

        outs = asyncio.run(run())
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        engine.shutdown()
        print(json.dumps({"tokens": sum(len(o["token_ids"]) for o in outs), "finish": outs[-1]["finish_reason"],
                          "grew_mib": (after - before) / 1024}))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 4 and got["finish"] == "length"
    assert got["grew_mib"] < 1024, got  # T x T of one head in fp32 alone is 1 GiB


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["offload", "hybrid"])
def test_on_cuda_a_32k_prompt_answers_at_default_settings_under_a_24_gib_limit(backend):
    """Qwen3-30B-A3B's geometry (8 of its layers), bf16, the expert cache filling a 24 GiB budget, every other
    setting at its default (the model's 40,960-token context, chunked prefill): a 32k-token prompt answers,
    and torch's allocator never held more than the limit (--gpu-memory-limit caps it)."""
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(EngineConfig(model="synthetic:qwen3-30b-a3b?layers=8", device="cuda", dtype="bfloat16",
                                 moe_backend=backend, moe_cache_auto=True, gpu_memory_limit=24))
    engine.start()
    try:
        engine.wait_ready(900)
        assert engine.config.max_seq_len == 40960
        prompt = prompt_of(32768, seed=7, vocab=150000)
        tokens, last = asyncio.run(generate(engine, "long", prompt, 8))
        assert len(tokens) == 8 and last["prompt_tokens"] == 32768 and "error" not in last
        peak = torch.cuda.max_memory_allocated()
        print(f"{backend}: peak allocated {peak / 2 ** 30:.2f} GiB")
        assert peak <= 24 * 2 ** 30
    finally:
        engine.shutdown()

"""The paged KV pool's size (runtime/kv_budget.py): --max-seq-len from the model, --kv-cache-memory or the
automatic share (one whole-context request + 4096 tokens per other running request), the refusal of a pool
that cannot hold one request, and the prefill workspace growing with --max-prefill-tokens."""

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.synthetic import synthetic_spec
from services.engine.runtime.kv_budget import decide_kv_budget, prefill_workspace_bytes, resolve_max_seq_len
from services.engine.runtime.kv_cache import BLOCK_SIZE, KVCache

SPEC = synthetic_spec("synthetic:qwen3-30b-a3b", 151936)  # 48 layers, 4 kv heads x 128: 96 KiB a token in bf16


def test_the_context_defaults_to_the_models_own():
    cfg = EngineConfig(model="synthetic:qwen3-30b-a3b")
    assert cfg.max_seq_len is None and resolve_max_seq_len(cfg, SPEC) == 40960 == cfg.max_seq_len
    assert resolve_max_seq_len(EngineConfig(model="x", max_seq_len=1000), SPEC) == 1000


def test_auto_holds_one_whole_context_and_4096_tokens_per_other_request():
    cfg = EngineConfig(model="synthetic:qwen3-30b-a3b", max_running_requests=8, dtype="bfloat16")
    b = decide_kv_budget(cfg, SPEC, torch.bfloat16)
    assert b.tokens == 40960 + 7 * 4096 and b.block_size == BLOCK_SIZE
    per_token = KVCache.nbytes_per_token(SPEC, torch.bfloat16)
    assert per_token == 96 * 1024 and b.nbytes == (b.tokens + BLOCK_SIZE) * per_token  # + the null block
    assert "auto" in b.how and "40960" in b.describe()


def test_an_explicit_size_and_a_pool_too_small_for_one_request():
    per_gib = (1 << 30) // (96 * 1024)  # tokens in a GiB at bf16
    b = decide_kv_budget(EngineConfig(model="m", max_seq_len=8192, kv_cache_memory=2.0), SPEC, torch.bfloat16)
    assert b.tokens == 2 * per_gib // BLOCK_SIZE * BLOCK_SIZE and "--kv-cache-memory 2" in b.how
    with pytest.raises(ValueError, match="cannot hold one request of --max-seq-len 40960"):
        decide_kv_budget(EngineConfig(model="m", kv_cache_memory=1.0), SPEC, torch.bfloat16)
    with pytest.raises(ValueError, match="--kv-cache-memory must be positive"):
        EngineConfig(model="m", kv_cache_memory=0)


def test_the_prefill_workspace_grows_with_the_chunk():
    small = prefill_workspace_bytes(EngineConfig(model="m", max_prefill_tokens=8192), SPEC, torch.bfloat16)
    big = prefill_workspace_bytes(EngineConfig(model="m", max_prefill_tokens=16384), SPEC, torch.bfloat16)
    assert big == 2 * small and 0.5 * (1 << 30) < small < 2 * (1 << 30)  # ~1.4 GiB at Qwen3-30B-A3B's width
    assert EngineConfig(model="m").max_prefill_tokens == 16384

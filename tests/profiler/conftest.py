"""Fixtures of the profiler tests: a small sharded MoE checkpoint. The real redis-server and Celery
worker come from tests/conftest.py (shared with the gateway's admin tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.profiler import synth_checkpoint

ROOT = Path(__file__).resolve().parents[2]

# A Qwen3-MoE geometry small enough for CI; layer 1 is dense (mlp_only_layers) so MoE ordinals != ids.
CONFIG = dict(model_type="qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1], decoder_sparse_step=1,
              num_experts=6, num_experts_per_tok=2, hidden_size=64, moe_intermediate_size=32,
              intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, norm_topk_prob=True)


def write_checkpoint(directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """CONFIG's experts in ~64 KiB shards: every MoE layer's experts span several files, interleaved
    with router and attention tensors (as a size-based Hub split does)."""
    return synth_checkpoint.write_checkpoint(directory, CONFIG, dtype, shard_bytes=64 << 10)


@pytest.fixture
def moe_checkpoint(tmp_path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")

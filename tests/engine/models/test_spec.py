"""ModelSpec normalisation of Hugging Face configs (the key spellings of real Hub configs)."""

from __future__ import annotations

import pytest

from services.engine.models.errors import LoaderError
from services.engine.models.spec import ModelSpec, QKNorm

BASE = dict(num_hidden_layers=6, hidden_size=64, num_attention_heads=4, num_experts_per_tok=2, vocab_size=100)


def spec(**kw) -> ModelSpec:
    return ModelSpec.from_hf_config({**BASE, **kw})


def test_qwen3_sparse_layers_head_dim_and_rope_theta_spellings():
    s = spec(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=16, mlp_only_layers=[0, 3],
             decoder_sparse_step=1, rope_theta=5e5)  # Hub spelling: rope_theta at the top level
    assert s.moe_layer_ids == (1, 2, 4, 5) and s.moe_ordinal(4) == 2 and s.moe_ordinal(3) is None
    assert s.head_dim == 16 and s.rope_theta == 5e5 and s.traits.qk_norm is QKNorm.PER_HEAD
    s = spec(model_type="qwen3_moe", num_local_experts=8, moe_intermediate_size=16, head_dim=128,
             rope_parameters={"rope_type": "default", "rope_theta": 1e6})  # transformers 5 spelling
    assert s.num_experts == 8 and s.head_dim == 128 and s.rope_theta == 1e6


def test_qwen2_sparse_step_shared_expert_and_bias_default():
    s = spec(model_type="qwen2_moe", num_experts=8, moe_intermediate_size=16, decoder_sparse_step=2,
             shared_expert_intermediate_size=32)
    assert s.moe_layer_ids == (1, 3, 5)
    assert s.qkv_bias and not s.o_bias  # Qwen1.5-MoE configs omit qkv_bias: biases on, none on o_proj
    assert s.shared_expert_intermediate_size == 32 and not s.renormalize


def test_mixtral_always_renormalises_and_every_layer_is_moe():
    s = spec(model_type="mixtral", num_local_experts=8, intermediate_size=32, decoder_sparse_step=2)
    assert s.moe_layer_ids == tuple(range(6)) and s.renormalize and s.moe_intermediate_size == 32
    assert s.traits.moe_prefix == "block_sparse_moe" and s.sliding_window is None
    assert spec(model_type="mixtral", num_local_experts=8, intermediate_size=32, sliding_window=4096).sliding_window == 4096


def test_olmoe_full_qk_norm_and_clip():
    s = spec(model_type="olmoe", num_experts=8, intermediate_size=32, clip_qkv=4.0, norm_topk_prob=False)
    assert s.traits.qk_norm is QKNorm.FULL and s.clip_qkv == 4.0 and not s.renormalize


@pytest.mark.parametrize("cfg, match", [
    (dict(model_type="deepseek_v2"), r"unsupported model_type 'deepseek_v2' \(supported: gpt_oss, mixtral, olmoe, qwen2_moe, qwen3_moe\)"),
    (dict(model_type="qwen3_moe", num_experts=8), r"missing key 'moe_intermediate_size'"),
    (dict(model_type="qwen3_moe", moe_intermediate_size=8), r"no expert count"),
    (dict(model_type="mixtral", num_local_experts=1, intermediate_size=8), r"num_experts_per_tok=2 must be in \[1, 1\]"),
    (dict(model_type="mixtral", num_local_experts=8, intermediate_size=8, rope_scaling={"rope_type": "longrope"}),
     r"rope_type 'longrope' is not supported \(default, yarn\)"),
    (dict(model_type="mixtral", num_local_experts=8, intermediate_size=8, rope_scaling={"rope_type": "yarn"}),
     r"rope_type 'yarn' needs 'factor'"),
    (dict(model_type="qwen3_moe", num_experts=8, moe_intermediate_size=8, use_sliding_window=True),
     r"use_sliding_window=true is not supported"),
])
def test_bad_configs(cfg, match):
    with pytest.raises(LoaderError, match=r"config\.json: " + match):
        spec(**cfg)

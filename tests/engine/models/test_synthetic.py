"""Synthetic models: presets build in memory, generate, and are deterministic for a seed."""

from __future__ import annotations

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.errors import LoaderError
from services.engine.models.registry import load_model
from services.engine.models.synthetic import synthetic_spec
from tests.helpers import greedy_generate


def test_tiny_builds_and_generates():
    lm = load_model(EngineConfig(model="synthetic:tiny"))
    assert lm.model_id == "synthetic:tiny"
    assert (lm.model_dir / "tokenizer.json").is_file() and (lm.model_dir / "generation_config.json").is_file()
    assert lm.spec.num_moe_layers == 2 and lm.spec.num_experts == 8
    out = greedy_generate(lm, [1, 2, 3, 4], 8)
    assert len(out) == 8 and all(0 <= t < lm.spec.vocab_size for t in out)
    again = greedy_generate(load_model(EngineConfig(model="synthetic:tiny")), [1, 2, 3, 4], 8)
    assert again == out  # same seed, same weights
    other = load_model(EngineConfig(model="synthetic:tiny", seed=1))
    assert not torch.equal(other.banks.layers[0].tensors["down"], lm.banks.layers[0].tensors["down"])


def test_layers_override_and_bf16():
    lm = load_model(EngineConfig(model="synthetic:tiny?layers=3", dtype="bfloat16"))
    assert lm.spec.num_layers == 3 and len(lm.banks.layers) == 3
    assert lm.banks.layers[0].tensors["gate_up"].dtype == torch.bfloat16
    assert len(greedy_generate(lm, [5, 6, 7], 4)) == 4


def test_weights_have_the_intended_scale():
    lm = load_model(EngineConfig(model="synthetic:tiny"))
    std = lm.banks.layers[0].tensors["gate_up"].std().item()
    assert 0.015 < std < 0.025
    assert torch.equal(lm.model.model.norm.weight, torch.ones_like(lm.model.model.norm.weight))


def test_real_geometries():
    spec = synthetic_spec("synthetic:qwen3-30b-a3b", tokenizer_vocab=0)
    assert (spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
            spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == (
            48, 128, 8, 2048, 768, 32, 4, 128, 151936)
    assert spec.expert_nbytes(torch.bfloat16) == 9_437_184  # the 9.4 MB of DESIGN.md §6
    # ~3.3 B active parameters per token (Qwen3-30B-A3B's "A3B")
    assert 3.0e9 < spec.active_weight_nbytes(torch.bfloat16) / 2 < 3.6e9
    mix = synthetic_spec("synthetic:mixtral-8x7b", tokenizer_vocab=0)
    assert (mix.num_layers, mix.num_experts, mix.top_k, mix.moe_intermediate_size) == (32, 8, 2, 14336)
    assert mix.traits.expert_proj == ("w1", "w3", "w2")


@pytest.mark.parametrize("model, match", [
    ("synthetic:nope", r"unknown synthetic preset 'nope' \(presets: tiny, qwen3-30b-a3b, mixtral-8x7b\)"),
    ("synthetic:tiny?layers=x", r"layers must be an integer"),
    ("synthetic:tiny?depth=2", r"unknown option 'depth'"),
])
def test_bad_names(model, match):
    with pytest.raises(LoaderError, match=match):
        load_model(EngineConfig(model=model))


def test_large_vocab_preset_gets_a_tokenizer_that_decodes_every_id(monkeypatch, tmp_path):
    from services.common.tokenizer import Tokenizer
    from services.engine.models.synthetic import tokenizer_dir

    monkeypatch.setenv("TANDEM_DEMO_DIR", str(tmp_path / "demo"))
    tok = Tokenizer.from_dir(tokenizer_dir("synthetic:mixtral-8x7b"))
    ids = [0, 500, 31999]  # 31999 lies far past the demo tokenizer's ~700 trained tokens
    assert all(tok.decode([i]) for i in ids)
    assert tok.decode([31999]) == "<|s31999|>"

"""Session fixtures for engine tests: tiny random checkpoints written by transformers' own classes
and ``save_pretrained`` (the independent reference), one per supported architecture.

Weights are re-drawn from a seeded generator (matrices N(0, 0.1), routers N(0, 1) so routing is
decisive, norms 1 + N(0, 0.1), biases N(0, 0.1)) so every tensor the loader copies matters.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.engine.config import EngineConfig
from services.engine.models.demo import write_tokenizer_files
from services.engine.models.registry import load_model

VOCAB = 128
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # head_dim 32 != hidden/heads (16): the spec must honour config.head_dim. Layer 1 dense.
    cfg = Qwen3MoeConfig(**COMMON, num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, intermediate_size=96, head_dim=32, mlp_only_layers=[1],
                         norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3MoeForCausalLM, cfg, None


def _qwen2():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    # decoder_sparse_step=2: layers 1 and 3 are MoE, 0 and 2 dense. Written sharded.
    cfg = Qwen2MoeConfig(**COMMON, num_hidden_layers=4, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=32, intermediate_size=96, shared_expert_intermediate_size=48,
                         decoder_sparse_step=2, norm_topk_prob=False)
    return Qwen2MoeForCausalLM, cfg, "200KB"


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    # A sliding window shorter than prompt + continuation, so the window mask is exercised.
    cfg = MixtralConfig(**COMMON, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                        intermediate_size=32, sliding_window=8)
    return MixtralForCausalLM, cfg, None


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM

    # Tied embeddings: save_pretrained writes no lm_head.weight; the loader must tie it again.
    cfg = OlmoeConfig(**{**COMMON, "tie_word_embeddings": True}, num_hidden_layers=2, num_experts=8,
                      num_experts_per_tok=2, intermediate_size=32, norm_topk_prob=False, eos_token_id=2, pad_token_id=0)
    return OlmoeForCausalLM, cfg, None


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    # gpt-oss's real rope (YaRN, factor 32) and alpha; a sliding window of 4 on layers 0 and 2 (layer 1 full),
    # shorter than prompt + continuation; swiglu_limit 1 (not 7) so the clamp bites at these weight scales.
    # Experts are rewritten in the Hub's MXFP4 layout after saving (_to_hub_mxfp4).
    cfg = GptOssConfig(**{**COMMON, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}, head_dim=16, num_hidden_layers=3,
                       num_local_experts=8, num_experts_per_tok=2, intermediate_size=32, sliding_window=4,
                       swiglu_limit=1.0,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                                        "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096})
    return GptOssForCausalLM, cfg, None


ARCHS = {"qwen3_moe": _qwen3, "qwen2_moe": _qwen2, "mixtral": _mixtral, "olmoe": _olmoe, "gpt_oss": _gpt_oss}


def _to_hub_mxfp4(d: Path) -> torch.nn.Module:
    """Rewrite the gpt-oss checkpoint in ``d`` as the Hub publishes it: experts as MXFP4 blocks/scales (our
    quantizer), ``quantization_config.quant_method: mxfp4``. Returns the reference: transformers' own load
    of that checkpoint with its MXFP4 quantizer in dequantize mode (fp32, CPU)."""
    import json

    from safetensors.torch import load_file, save_file

    from services.engine.models import mxfp4

    path = d / "model.safetensors"
    sd = load_file(path)
    for name in [n for n in sd if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(sd.pop(name).transpose(1, 2))  # [E, out, in] rows, blocks along in
        sd[name + "_blocks"], sd[name + "_scales"] = blocks, scales
    save_file(sd, path, metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return load_gpt_oss_reference(d)


def load_gpt_oss_reference(d: Path) -> torch.nn.Module:
    """transformers' fp32 CPU model of the Hub-layout gpt-oss checkpoint in ``d`` (MXFP4 dequantized by its
    quantizer), eager attention."""
    import json

    from transformers import GptOssForCausalLM, Mxfp4Config

    cfg = json.loads((d / "config.json").read_text())
    hf = GptOssForCausalLM.from_pretrained(d, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32)
    hf.config._attn_implementation = "eager"
    # Older transformers (the GPU image's 5.17) hard-code GptOssExperts.limit = 7.0 (no swiglu_limit field; the
    # forward reads self.limit) and dequantize MXFP4 experts to bf16 on the CPU: the reference then clamps at 7
    # instead of this checkpoint's 1 and gives other greedy tokens from the 4th on. The checkpoint's limit and
    # fp32 (MXFP4 values are exact in bf16, so nothing is lost) make it the checkpoint's model on any version.
    for layer in hf.model.layers:
        layer.mlp.experts.limit = cfg["swiglu_limit"]
    return hf.float().eval()


POST_SAVE = {"gpt_oss": _to_hub_mxfp4}  # architectures whose Hub layout differs from save_pretrained's


@dataclass
class HFCheckpoint:
    name: str
    dir: Path
    hf: torch.nn.Module  # the transformers model the checkpoint was saved from (eval, fp32)


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif (name.endswith(("gate.weight", "router.weight")) and "experts" not in name) or name.endswith("sinks"):
                p.copy_(noise)  # routers (and Qwen2's shared_expert_gate): decisive top-k; gpt-oss sinks
            else:
                p.copy_(0.1 * noise)


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, HFCheckpoint]:
    out = {}
    for seed, (name, make) in enumerate(ARCHS.items()):
        cls, cfg, shard = make()
        cfg._attn_implementation = "eager"
        torch.manual_seed(seed)
        model = cls(cfg).eval()
        _randomize_(model, seed)
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d, **({"max_shard_size": shard} if shard else {}))
        if name in POST_SAVE:
            model = POST_SAVE[name](d)
        write_tokenizer_files(d)
        out[name] = HFCheckpoint(name, d, model)
    return out


@pytest.fixture(scope="module")
def loaded(hf_checkpoints):
    """One model per architecture loaded from ``hf_checkpoints`` with no backend attached (tests attach
    their own); module scope because tests swap backends on it."""
    return {name: load_model(EngineConfig(model=str(c.dir)), attach_backend=False) for name, c in hf_checkpoints.items()}

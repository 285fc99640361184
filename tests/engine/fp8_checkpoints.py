"""Tiny fine-grained FP8 checkpoints in the exact on-disk layout of the Hub's FP8 releases
(Qwen/Qwen3-30B-A3B-FP8): transformers' own class saves the model, then every linear weight of the
attention, the dense MLP and the experts is rewritten as float8_e4m3fn ``X.weight`` plus
``X.weight_scale_inv`` per 128x128 block (ceil grid), and ``config.json`` gets the quantization_config.
Norms, embeddings, the router and lm_head stay as they are (the releases' modules_to_not_convert).

The quantizer here is written from the format's definition, apart from services/engine/moe/fp8.py, and
the returned transformers model holds the dequantized weights (fp32): the reference the engine's greedy
tokens must equal. Sizes cross block edges: D = 192 (one whole block + 64), I = 160 (+32), k_proj's
96 rows (one partial block). Layer 1's scales are stored in bfloat16, the others' in float32.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from services.engine.models.demo import write_tokenizer_files

BLOCK = 128
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}
_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_quantize(w: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q fp8, scale_inv [ceil(N/128), ceil(K/128)] in scale_dtype, dequantized fp32), block by block."""
    N, K = w.shape
    scale = torch.empty(math.ceil(N / BLOCK), math.ceil(K / BLOCK), dtype=scale_dtype)
    q = torch.empty(N, K, dtype=torch.float8_e4m3fn)
    deq = torch.empty(N, K)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK)
            s = (w[rows, cols].abs().max() / 448.0).to(scale_dtype)  # the stored scale is what dequantizes
            scale[i, j] = s
            q[rows, cols] = (w[rows, cols] / s.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
            deq[rows, cols] = q[rows, cols].float() * s.float()
    return q, scale, deq


def is_quantized(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in _LINEAR


def qwen3_fp8_model(seed: int = 11):
    """A transformers Qwen3-MoE (eval, fp32, random weights as tests/engine/conftest.py draws them)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.engine.conftest import _randomize_

    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=192, num_attention_heads=4, num_key_value_heads=2, head_dim=48,
                         rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False,
                         num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=160,
                         intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).eval()
    _randomize_(model, seed)
    return model


def write_fp8_checkpoint(model: torch.nn.Module, out: Path, bf16_scale_layers: tuple[int, ...] = (1,)) -> None:
    """Save ``model`` to ``out`` as a fine-grained FP8 checkpoint and load the dequantized weights back into
    ``model`` (so it becomes the reference for the file)."""
    model.save_pretrained(out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    dequantized = {}
    for name in [n for n in tensors if is_quantized(n)]:
        layer = int(name.split(".")[2])
        scale_dtype = torch.bfloat16 if layer in bf16_scale_layers else torch.float32
        q, scale, deq = block_quantize(tensors[name].float(), scale_dtype)
        tensors[name], tensors[name + "_scale_inv"] = q, scale
        dequantized[name] = deq
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer_files(out)
    _load_dequantized(model, dequantized)


def _load_dequantized(model: torch.nn.Module, dequantized: dict[str, torch.Tensor]) -> None:
    """Copy the per-expert dequantized tensors into transformers' modules (its experts are fused in memory:
    ``experts.gate_up_proj [E, 2I, D]`` (gate rows, then up) and ``experts.down_proj [E, D, I]``)."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, w in dequantized.items():
            if name in params:
                params[name].copy_(w)
                continue
            prefix, e, proj, _ = name.rsplit(".", 3)  # "model.layers.L.mlp.experts", "e", "x_proj", "weight"
            e = int(e)
            if proj == "down_proj":
                params[prefix + ".down_proj"][e].copy_(w)
            else:
                gate_up = params[prefix + ".gate_up_proj"][e]  # [2I, D]
                I = gate_up.shape[0] // 2
                gate_up[:I].copy_(w) if proj == "gate_proj" else gate_up[I:].copy_(w)

"""Tiny GGUF files written from transformers models, the way llama.cpp's convert_hf_to_gguf.py lays them out
(its tensor names and metadata keys, written with the gguf package's GGUFWriter): the inputs of the GGUF
parity tests. The HF -> GGUF name table here is the converter's, written independently of the engine's
loader (models/gguf_loader.py reads the other way).

Experts: q8_0 and mxfp4 quantized from the model's weights by the gguf package's quantizers; the K types
(which the package cannot quantize) as random valid blocks (models/gguf_random.py). The model's own expert
weights are then not what the file holds: references read the file (transformers' GGUF loader), or get the
file's dequantized experts put back (``dequantized_reference``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch

from services.engine.models.demo import write_tokenizer_files

# transformers parameter (per layer, after "model.layers.N.") -> llama.cpp tensor (after "blk.N.")
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
          "lm_head.weight": "output.weight"}
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "gpt_oss": "gpt-oss", "olmoe": "olmoe", "mixtral": "llama"}


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py), applied to attn_q / attn_k of the llama family."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
GGML = {"q4_K": "Q4_K", "q5_K": "Q5_K", "q6_K": "Q6_K", "q8_0": "Q8_0", "mxfp4_gguf": "MXFP4", "f32": "F32"}


def _tokenizer_metadata(w, pre: str, tmp: Path) -> None:
    """The demo tokenizer as llama.cpp's converter writes a byte-level BPE (its vocab in id order, added tokens
    as CONTROL, the merges, the chat template)."""
    import json

    import gguf

    write_tokenizer_files(tmp)
    tok = json.loads((tmp / "tokenizer.json").read_text())
    cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    tokens = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(vocab[cfg["bos_token"]])
    w.add_eos_token_id(vocab[cfg["eos_token"]])
    w.add_pad_token_id(vocab[cfg["pad_token"]])
    w.add_chat_template(cfg["chat_template"])


def _quantized(values: torch.Tensor, qtype: str, gen: torch.Generator) -> np.ndarray:
    """values [..., cols] as GGUF blocks uint8 [..., row bytes] (q8_0 / mxfp4 by the package's quantizer, the
    K types random blocks of the values' spread); f32 as float32."""
    import gguf

    from services.engine.models.gguf_random import random_blocks_
    from services.engine.moe.gguf_quant import row_bytes as gguf_row_bytes

    if qtype == "f32":
        return values.float().numpy()
    if qtype in ("q8_0", "mxfp4_gguf"):
        return gguf.quantize(values.float().numpy(), gguf.GGMLQuantizationType[GGML[qtype]])
    out = torch.empty((*values.shape[:-1], gguf_row_bytes(qtype, values.shape[-1])), dtype=torch.uint8)
    return random_blocks_(out, qtype, float(values.float().std()), gen).numpy()


def write_gguf(hf, path: Path, expert_types, pre: str = "qwen2", seed: int = 0, dense_type: str = "f32") -> Path:
    """Write transformers model ``hf`` as a GGUF file at ``path``. ``expert_types``: per MoE layer ordinal a
    (gate/up type, down type) pair, or one pair for all; ``dense_type``: token_embd's type (other non-expert
    tensors are F32, as llama.cpp keeps norms)."""
    import gguf

    cfg = hf.config
    model_type = cfg.model_type
    arch = ARCH[model_type]
    L = cfg.num_hidden_layers
    moe = [i for i in range(L) if hasattr(hf.model.layers[i].mlp, "experts")]
    types = expert_types if isinstance(expert_types, list) else [expert_types] * len(moe)
    gen = torch.Generator().manual_seed(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if model_type in ("qwen3_moe", "qwen2_moe", "gpt_oss"):  # llama / olmoe: feed_forward_length is the experts'
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size if model_type != "gpt_oss" else cfg.intermediate_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    if model_type == "olmoe" and cfg.clip_qkv is not None:
        w.add_clamp_kqv(cfg.clip_qkv)
    if model_type == "mixtral":
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    if model_type == "qwen3_moe":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    if model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if model_type == "gpt_oss":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _tokenizer_metadata(w, pre, path.parent / (path.stem + ".tokenizer"))

    sd = hf.state_dict()
    for name, t in sd.items():
        if name in GLOBAL:
            gname = GLOBAL[name]
        elif ".experts." in name:
            continue
        else:
            layer, rest = name.split(".", 3)[2:]
            if rest == "post_attention_layernorm.weight":
                gname = "post_attention_norm.weight" if model_type == "gpt_oss" else "ffn_norm.weight"
            else:
                gname = LAYER[rest]
            gname = f"blk.{layer}.{gname}"
        values = t.detach().float()
        if model_type == "mixtral" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            values = permute_qk(values, cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads)
        if gname.endswith("ffn_gate_inp_shexp.weight"):
            values = values.reshape(-1)  # llama.cpp stores the shared-expert gate as a vector [D]
        qtype = dense_type if gname == "token_embd.weight" else "f32"
        data = _quantized(values, qtype, gen)
        w.add_tensor(gname, data, raw_dtype=gguf.GGMLQuantizationType[GGML[qtype]])
    for ordinal, layer in enumerate(moe):
        gu_type, down_type = types[ordinal]
        gate, up, down = _expert_weights(hf.model.layers[layer].mlp.experts, model_type)
        for p, v, qt in (("gate", gate, gu_type), ("up", up, gu_type), ("down", down, down_type)):
            w.add_tensor(f"blk.{layer}.ffn_{p}_exps.weight", _quantized(v, qt, gen),
                         raw_dtype=gguf.GGMLQuantizationType[GGML[qt]])
        if model_type == "gpt_oss":
            ex = hf.model.layers[layer].mlp.experts
            b = ex.gate_up_proj_bias.detach().float()  # [E, 2I] interleaved
            for p, v in (("gate", b[:, 0::2]), ("up", b[:, 1::2]), ("down", ex.down_proj_bias.detach().float())):
                w.add_tensor(f"blk.{layer}.ffn_{p}_exps.bias", v.contiguous().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _expert_weights(experts, model_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(gate [E, I, D], up [E, I, D], down [E, D, I]) of a transformers experts module."""
    if model_type == "gpt_oss":  # gate_up_proj [E, D, 2I] with gate/up interleaved, down_proj [E, I, D]
        gu = experts.gate_up_proj.detach().float()
        return (gu[..., 0::2].transpose(1, 2).contiguous(), gu[..., 1::2].transpose(1, 2).contiguous(),
                experts.down_proj.detach().float().transpose(1, 2).contiguous())
    gu = experts.gate_up_proj.detach().float()  # [E, 2I, D]: gate rows then up rows
    I = gu.shape[1] // 2
    return gu[:, :I].contiguous(), gu[:, I:].contiguous(), experts.down_proj.detach().float().contiguous()


def dequantized_reference(hf, path: Path):
    """A copy of transformers model ``hf`` whose every tensor is what the GGUF file at ``path`` holds,
    dequantized by the gguf package (the 'dequantized safetensors' reference, for architectures
    transformers' GGUF loader does not read); llama's q/k permutation undone by transformers' own
    LlamaTensorProcessor."""
    import gguf

    ref = copy.deepcopy(hf)
    reader = gguf.GGUFReader(str(path))
    dense = {t.name: torch.from_numpy(np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32))
             for t in reader.tensors}
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if ".experts." in name:
                continue
            if name in GLOBAL:
                gname = GLOBAL[name]
            else:
                layer, rest = name.split(".", 3)[2:]
                gname = "post_attention_norm.weight" if rest == "post_attention_layernorm.weight" and \
                    hf.config.model_type == "gpt_oss" else ("ffn_norm.weight" if rest == "post_attention_layernorm.weight"
                                                            else LAYER[rest])
                gname = f"blk.{layer}.{gname}"
            values = dense[gname]
            if hf.config.model_type == "mixtral" and gname.endswith(("attn_q.weight", "attn_k.weight")):
                from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

                cfg = hf.config
                heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
                values = torch.from_numpy(LlamaTensorProcessor()._reverse_permute_weights(
                    values.numpy(), cfg.num_attention_heads, heads))
            p.copy_(values.view(p.shape))
        for layer, block in enumerate(ref.model.layers):
            if not hasattr(block.mlp, "experts"):
                continue
            ex = block.mlp.experts
            gate, up, down = (dense[f"blk.{layer}.ffn_{p}_exps.weight"] for p in ("gate", "up", "down"))
            if hf.config.model_type == "gpt_oss":
                gu = torch.empty_like(ex.gate_up_proj)  # [E, D, 2I]
                gu[..., 0::2], gu[..., 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
                ex.gate_up_proj.copy_(gu)
                ex.down_proj.copy_(down.transpose(1, 2))
                bias = torch.empty_like(ex.gate_up_proj_bias)
                bias[:, 0::2], bias[:, 1::2] = dense[f"blk.{layer}.ffn_gate_exps.bias"], dense[f"blk.{layer}.ffn_up_exps.bias"]
                ex.gate_up_proj_bias.copy_(bias)
                ex.down_proj_bias.copy_(dense[f"blk.{layer}.ffn_down_exps.bias"])
            else:
                ex.gate_up_proj.copy_(torch.cat([gate, up], dim=1))
                ex.down_proj.copy_(down)
    return ref.eval()

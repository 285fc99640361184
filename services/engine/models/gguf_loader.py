"""Load a GGUF model (llama.cpp's format) into a MoECausalLM and ExpertBanks: ``--model FILE.gguf``.

- The metadata becomes the Hugging Face config dict the architecture's config.json would be
  (``gguf_config``), normalised by the same ModelSpec.from_hf_config as a checkpoint directory.
- Non-expert tensors (attention, norms, router, embeddings, LM head, dense and shared MLPs) are
  dequantized to the model dtype with the ``gguf`` package's numpy reference.
- Routed experts stay in their GGUF type: per MoE layer ``ffn_gate_exps`` [E, I, D] and ``ffn_up_exps``
  (one type, stacked into the gate_up bank as rows [0, I) and [I, 2I)) and ``ffn_down_exps`` [E, D, I]
  (its own type: a Q4_K_M file's down is q6_K in some layers) are copied block for block into the
  banks of the layer's format (moe/banks.py GGUF_TYPES). F32/F16/BF16 experts load unquantized.

Q/K permutation: llama.cpp's converter permutes the rows of attn_q / attn_k for the ``llama`` family
(LlamaModel.permute: per head, the two rotary halves interleaved, for its GGML rope), which includes
Mixtral (architecture ``llama`` with experts); the loader reverses it (as transformers'
LlamaTensorProcessor does). qwen2moe, qwen3moe, gpt-oss and olmoe are converted unpermuted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from services.common.logging import get_logger
from services.engine.models.causal_lm import MoECausalLM
from services.engine.models.errors import LoaderError
from services.engine.models.gguf_reader import GGUFFile
from services.engine.models.loader import LoadProgress, build_empty_model
from services.engine.models.spec import ModelSpec
from services.engine.moe.banks import ExpertBanks, ExpertFormat, gguf_format

log = get_logger("gguf_loader")
Progress = Callable[[dict], None]


@dataclass(frozen=True)
class GGUFArch:
    """What a GGUF architecture's metadata does not say, as llama.cpp's graph for it assumes."""

    model_type: str  # the engine's (Hugging Face) model_type
    expert_width_key: str  # the HF config key of the expert intermediate size
    norm_topk_prob: bool  # llama.cpp renormalises the top-k weights (qwen3moe yes, qwen2moe no)
    qkv_bias_key: str  # the HF config key saying q/k/v have biases (read off the tensors here)
    permuted_qk: bool = False  # llama.cpp's converter permuted attn_q / attn_k rows (module docstring)


ARCHS: dict[str, GGUFArch] = {
    "qwen3moe": GGUFArch("qwen3_moe", "moe_intermediate_size", True, "attention_bias"),
    "qwen2moe": GGUFArch("qwen2_moe", "moe_intermediate_size", False, "qkv_bias"),
    "gpt-oss": GGUFArch("gpt_oss", "intermediate_size", True, "attention_bias"),
    "olmoe": GGUFArch("olmoe", "intermediate_size", False, "attention_bias"),
    "llama": GGUFArch("mixtral", "intermediate_size", True, "attention_bias", permuted_qk=True),  # with experts only
}

# engine (Hugging Face) parameter name -> GGUF tensor name(s), first present wins; per decoder layer
# ``model.layers.N.`` <-> ``blk.N.``
GLOBAL_NAMES = {"model.embed_tokens.weight": ("token_embd.weight",), "model.norm.weight": ("output_norm.weight",),
                "lm_head.weight": ("output.weight",)}
LAYER_NAMES = {
    "input_layernorm.weight": ("attn_norm.weight",),
    "post_attention_layernorm.weight": ("ffn_norm.weight", "post_attention_norm.weight"),  # gpt-oss: the latter
    **{f"self_attn.{p}_proj.{w}": (f"attn_{g}.{w}",) for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for w in ("weight", "bias")},
    "self_attn.q_norm.weight": ("attn_q_norm.weight",),
    "self_attn.k_norm.weight": ("attn_k_norm.weight",),
    "self_attn.sinks": ("attn_sinks.weight", "attn_sinks"),  # the converter appends .weight; accept the bare name
    "mlp.gate.weight": ("ffn_gate_inp.weight",),  # the router
    "block_sparse_moe.gate.weight": ("ffn_gate_inp.weight",),  # Mixtral's
    "mlp.router.weight": ("ffn_gate_inp.weight",),
    "mlp.router.bias": ("ffn_gate_inp.bias",),
    **{f"mlp.{p}_proj.weight": (f"ffn_{p}.weight",) for p in ("gate", "up", "down")},  # dense layers
    **{f"mlp.shared_expert.{p}_proj.weight": (f"ffn_{p}_shexp.weight",) for p in ("gate", "up", "down")},
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight",),  # [D] in GGUF, [1, D] here
}
# GGUF type name -> the banks' type name (moe/gguf_quant.py GGUFType values); F32/F16/BF16 experts load unquantized
EXPERT_TYPES = {"Q4_K": "q4_K", "Q5_K": "q5_K", "Q6_K": "q6_K", "Q8_0": "q8_0", "MXFP4": "mxfp4_gguf"}
PLAIN_TYPES = ("F32", "F16", "BF16")


def supported() -> str:
    archs = ", ".join(name if name != "llama" else "llama with experts (Mixtral)" for name in ARCHS)
    return f"architectures {archs}; expert types {', '.join(EXPERT_TYPES)} (or {'/'.join(PLAIN_TYPES)})"


def gguf_name(param: str) -> tuple[str, ...]:
    """The GGUF tensor names that may hold engine parameter ``param`` (LoaderError if none is known)."""
    if param in GLOBAL_NAMES:
        return GLOBAL_NAMES[param]
    parts = param.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_NAMES:
        return tuple(f"blk.{parts[2]}.{n}" for n in LAYER_NAMES[parts[3]])
    raise LoaderError(f"no GGUF tensor name is known for the engine's parameter {param!r}")


def expert_names(layer: int) -> dict[str, str]:
    return {p: f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}


def gguf_config(f: GGUFFile) -> dict:
    """The GGUF metadata as the Hugging Face config dict of the same model (for ModelSpec.from_hf_config)."""
    if f.arch not in ARCHS:
        raise LoaderError(f"{f.path}: GGUF architecture {f.arch!r} is not supported (supported: {supported()})")
    a = ARCHS[f.arch]
    if not f.get(".expert_count", 0):
        raise LoaderError(f"{f.path}: GGUF architecture {f.arch!r} without experts (a dense model) is not supported "
                          "(Tandem serves MoE models)")
    L = int(f.get(".block_count"))
    heads = int(f.get(".attention.head_count"))
    cfg = {
        "model_type": a.model_type,
        "num_hidden_layers": L,
        "hidden_size": int(f.get(".embedding_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(f.get(".attention.head_count_kv", heads)),
        "head_dim": f.get(".attention.key_length", None),
        "rms_norm_eps": float(f.get(".attention.layer_norm_rms_epsilon")),
        "rope_theta": float(f.get(".rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(".context_length", 4096)),
        "num_experts": int(f.get(".expert_count")),
        "num_experts_per_tok": int(f.get(".expert_used_count")),
        "intermediate_size": int(f.get(".feed_forward_length", 0)),
        "shared_expert_intermediate_size": int(f.get(".expert_shared_feed_forward_length", 0)),
        "vocab_size": f.shape("token_embd.weight")[0],
        "tie_word_embeddings": "output.weight" not in f,
        "norm_topk_prob": bool(f.get(".expert_weights_norm", a.norm_topk_prob)),
        # llama.cpp tells MoE layers by their tensors: a layer without ffn_gate_exps is dense
        "mlp_only_layers": [i for i in range(L) if expert_names(i)["gate"] not in f],
        a.qkv_bias_key: "blk.0.attn_q.bias" in f,
    }
    # the expert width: the metadata's, else the first MoE layer's tensors' (llama.cpp writes no
    # expert_feed_forward_length for llama / olmoe, whose feed_forward_length is the experts')
    first = next((i for i in range(L) if i not in cfg["mlp_only_layers"]), None)
    if first is None:  # early Mixtral conversions stored one tensor per expert (blk.N.ffn_gate.E.weight)
        raise LoaderError(f"{f.path}: no stacked expert tensors (blk.N.ffn_gate_exps.weight) in a model of "
                          f"{cfg['num_experts']} experts; files with one tensor per expert (early conversions) are "
                          "not supported: convert it again with a current llama.cpp")
    width = f.get(".expert_feed_forward_length", None)
    # gpt-oss / olmoe / mixtral: the expert width goes over intermediate_size
    cfg[a.expert_width_key] = int(width if width is not None else f.shape(expert_names(first)["gate"])[1])
    if a.model_type == "olmoe" and f.get(".attention.clamp_kqv", None) is not None:
        cfg["clip_qkv"] = float(f.get(".attention.clamp_kqv"))
    if a.model_type == "gpt_oss":
        cfg["sliding_window"] = int(f.get(".attention.sliding_window"))
        rope_type = f.get(".rope.scaling.type", "none")
        if rope_type == "yarn":  # gpt-oss's beta_fast / beta_slow / truncate: not in the metadata
            cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": cfg["rope_theta"],
                                      "factor": float(f.get(".rope.scaling.factor")),
                                      "original_max_position_embeddings": int(f.get(".rope.scaling.original_context_length")),
                                      "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
        elif rope_type != "none":
            raise LoaderError(f"{f.path}: gpt-oss rope scaling {rope_type!r} is not supported (yarn or none)")
    return cfg


def read_spec(f: GGUFFile) -> ModelSpec:
    return ModelSpec.from_hf_config(gguf_config(f), source=str(f.path))


def layer_format(f: GGUFFile, layer: int) -> ExpertFormat:
    """The bank format of MoE layer ``layer``'s experts, from their tensors' types (LoaderError naming the
    tensor and what is supported otherwise)."""
    names = expert_names(layer)
    types = {p: f.qtype(n).name for p, n in names.items()}
    for p, t in types.items():
        if t not in EXPERT_TYPES and t not in PLAIN_TYPES:
            raise LoaderError(f"{f.path}: expert tensor {names[p]!r} has type {t}, which the engine does not hold "
                              f"(supported: {supported()})")
    if types["gate"] != types["up"]:
        raise LoaderError(f"{f.path}: {names['gate']!r} is {types['gate']} but {names['up']!r} is {types['up']}; the "
                          "engine stacks gate and up into one bank and needs them in one type")
    plain = [t in PLAIN_TYPES for t in types.values()]
    if any(plain):
        if not all(plain):
            raise LoaderError(f"{f.path}: MoE layer {layer} mixes quantized and unquantized expert tensors "
                              f"({', '.join(f'{p} {t}' for p, t in types.items())})")
        return ExpertFormat.UNQUANTIZED
    try:
        return gguf_format(EXPERT_TYPES[types["gate"]], EXPERT_TYPES[types["down"]])
    except ValueError as e:
        raise LoaderError(f"{f.path}: MoE layer {layer}: {e}") from None


def load_gguf(path: str | Path, device: torch.device, dtype: torch.dtype,
              progress: Progress | None = None) -> tuple[ModelSpec, MoECausalLM, ExpertBanks, GGUFFile]:
    """Load the GGUF model at ``path``: (spec, model with non-expert weights on ``device`` in ``dtype``,
    host ExpertBanks in the file's types, the open file). ``progress`` as loader.load_checkpoint's."""
    f = GGUFFile(path)
    spec = read_spec(f)
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    formats = [layer_format(f, layer) for layer in spec.moe_layer_ids]
    if len(set(f is ExpertFormat.UNQUANTIZED for f in formats)) > 1:
        raise LoaderError(f"{path}: some MoE layers' experts are quantized, others not; the engine needs one or the other")
    try:
        banks = ExpertBanks.allocate(formats, spec.num_moe_layers, E, D, I, dtype, bias=spec.expert_bias,
                                     activation=spec.expert_activation)
    except ValueError as e:
        raise LoaderError(f"{path}: {e}") from None
    model = build_empty_model(spec, torch.device(device), dtype)
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    total = len(params) + spec.num_moe_layers * (3 + (3 if spec.expert_bias else 0))
    step = LoadProgress(total, Path(path).name, progress)

    try:
        with torch.no_grad():
            for name, param in params.items():
                candidates = gguf_name(name)
                src = next((n for n in candidates if n in f), candidates[0])
                values = f.dense(src)
                if ARCHS[f.arch].permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
                    values = unpermute_qk(values, spec.num_heads if "q_proj" in name else spec.num_kv_heads)
                if values.numel() != param.numel():
                    raise LoaderError(f"{f.path}: tensor {src!r} has shape {list(values.shape)}, the model needs "
                                      f"{list(param.shape)} for {name}")
                param.copy_(values.view(param.shape))
                step()
            for ordinal, layer in enumerate(spec.moe_layer_ids):
                _load_layer(f, spec, layer, banks.layers[ordinal], step)
    finally:
        step.close()
    log.info("loaded %s: %s, %d layers (%d MoE), E=%d, A=%d, D=%d, I=%d, experts %s", path, spec.model_type,
             spec.num_layers, spec.num_moe_layers, E, spec.top_k, D, I,
             ", ".join(sorted({fmt.value for fmt in formats})))
    return spec, model, banks, f


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's LlamaModel.permute of attn_q / attn_k [heads * Dh, D]: per head its rows were
    (pairs of the two rotary halves) interleaved; back to the halves one after the other."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_layer(f: GGUFFile, spec: ModelSpec, layer: int, banks, step: Callable[[], None]) -> None:
    """Copy decoder layer ``layer``'s experts into ``banks`` (a LayerBanks): blocks as they are, or values
    for unquantized banks; gpt-oss's expert biases into the bias banks."""
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    names = expert_names(layer)
    gate_up, down = banks.tensors["gate_up"], banks.tensors["down"]  # [E, 2I, *], [E, D, *]
    want = {"gate": (E, I, D), "up": (E, I, D), "down": (E, D, I)}
    for p, n in names.items():
        if f.shape(n) != want[p]:
            raise LoaderError(f"{f.path}: tensor {n!r} has shape {list(f.shape(n))}, expected {list(want[p])}")
    rows = {"gate": (gate_up, slice(0, I)), "up": (gate_up, slice(I, 2 * I)), "down": (down, slice(0, D))}
    for p, n in names.items():
        bank, r = rows[p]
        if banks.format is ExpertFormat.UNQUANTIZED:
            bank[:, r].copy_(f.dense(n))
        else:
            src = f.blocks(n)  # [E, rows, row bytes of the tensor's type]
            bank[:, r, :src.shape[-1]].copy_(src)  # a wider bank row (a layer of a narrower type): the rest unused
        step()
    if spec.expert_bias:  # gpt-oss: ffn_{gate,up}_exps.bias [E, I], ffn_down_exps.bias [E, D]
        bias = {p: f.dense(n.replace(".weight", ".bias"), (E, D if p == "down" else I)) for p, n in names.items()}
        banks.tensors["gate_up_bias"][:, :I].copy_(bias["gate"])
        step()
        banks.tensors["gate_up_bias"][:, I:].copy_(bias["up"])
        step()
        banks.tensors["down_bias"].copy_(bias["down"])
        step()


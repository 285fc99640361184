"""ModelSpec: one normalised description of a MoE checkpoint, built from a Hugging Face config.json.

Architectures are a table of traits (gpt-fast ``transformer_configs`` style), not an if-chain: the
model, the loader and the synthetic builder read the traits, never ``model_type`` itself.

Dimension legend: L layers · E experts per MoE layer · A experts per token (top-k) · D hidden size ·
I expert intermediate size · H query heads · K kv heads · Dh head dim · V vocab.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from services.engine.models.errors import LoaderError
from services.engine.moe.reference import ClampedSwiGLU


class QKNorm(str, enum.Enum):
    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3: RMSNorm over Dh, one weight [Dh] shared by all heads
    FULL = "full"  # OLMoE: RMSNorm over the whole projection, weight [H*Dh] (q) / [K*Dh] (k)


class ExpertLayout(str, enum.Enum):
    PER_EXPERT = "per_expert"  # one [I, D] / [D, I] tensor per expert and projection (or the fused in-memory names)
    GPT_OSS = "gpt_oss"  # fused [E, D, 2I] with gate/up in interleaved columns, [E, I, D] down, biases; or MXFP4


class RouterNorm(str, enum.Enum):
    CONFIG = "config"  # renormalise the top-k probabilities iff config.norm_topk_prob
    ALWAYS = "always"  # Mixtral: softmax over the top-k logits == top-k probabilities renormalised


@dataclass(frozen=True)
class ArchTraits:
    """How one architecture differs from the common decoder (Llama-style, pre-norm, SwiGLU)."""

    qk_norm: QKNorm = QKNorm.NONE
    qkv_bias_key: str | None = None  # config key saying q/k/v projections have biases (None: never)
    qkv_bias_default: bool = False  # when the key is absent (Qwen1.5-MoE configs omit it: biases on)
    o_bias: bool = True  # o_proj has a bias too when q/k/v have one (Qwen2-MoE: never)
    router_norm: RouterNorm = RouterNorm.CONFIG
    shared_expert: bool = False  # Qwen2-MoE: a dense shared expert scaled by sigmoid(shared_expert_gate)
    sparse_step: bool = False  # dense layers from `mlp_only_layers` / `decoder_sparse_step`
    clip_qkv: bool = False  # OLMoE: clamp q/k/v to +-config.clip_qkv when set
    sliding_window: bool = False  # Mixtral: config.sliding_window (when set) limits every layer's keys
    moe_prefix: str = "mlp"  # module holding the router and experts in tensor names
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down names
    expert_intermediate_key: str = "moe_intermediate_size"  # I; Mixtral/OLMoE use intermediate_size
    default_norm_topk_prob: bool = False
    router_name: str = "gate"  # gpt-oss: "router"
    router_bias: bool = False  # gpt-oss: the router linear has a bias
    attention_sinks: bool = False  # gpt-oss: a learned per-head logit in every softmax, its value dropped
    layer_types: bool = False  # gpt-oss: config.layer_types says which layers use the sliding window
    expert_layout: ExpertLayout = ExpertLayout.PER_EXPERT  # GPT_OSS: expert biases and the clamped SwiGLU too


ARCHITECTURES: dict[str, ArchTraits] = {
    "qwen3_moe": ArchTraits(qk_norm=QKNorm.PER_HEAD, qkv_bias_key="attention_bias", sparse_step=True),
    "qwen2_moe": ArchTraits(qkv_bias_key="qkv_bias", qkv_bias_default=True, o_bias=False,
                            shared_expert=True, sparse_step=True),
    "mixtral": ArchTraits(router_norm=RouterNorm.ALWAYS, sliding_window=True, moe_prefix="block_sparse_moe",
                          expert_proj=("w1", "w3", "w2"), expert_intermediate_key="intermediate_size"),
    "olmoe": ArchTraits(qk_norm=QKNorm.FULL, qkv_bias_key="attention_bias", clip_qkv=True,
                        expert_intermediate_key="intermediate_size"),
    "gpt_oss": ArchTraits(qkv_bias_key="attention_bias", qkv_bias_default=True, router_norm=RouterNorm.ALWAYS,
                          expert_intermediate_key="intermediate_size", router_name="router", router_bias=True,
                          attention_sinks=True, layer_types=True, expert_layout=ExpertLayout.GPT_OSS),
}

SLIDING_LAYER = "sliding_attention"  # config.layer_types entry of a windowed layer (the other: "full_attention")
SUPPORTED_ROPE = ("default", "yarn")

# Older configs spell some keys differently; first present wins.
_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts")


def supported_model_types() -> str:
    return ", ".join(sorted(ARCHITECTURES))


@dataclass(frozen=True)
class ModelSpec:
    """Everything the engine needs to know about a checkpoint's geometry (sizes in elements)."""

    model_type: str
    traits: ArchTraits
    num_layers: int  # all decoder layers (dense + MoE)
    moe_layer_ids: tuple[int, ...]  # decoder-layer indices that are MoE layers, ascending
    num_experts: int  # E
    top_k: int  # A
    hidden_size: int  # D
    moe_intermediate_size: int  # I
    intermediate_size: int  # dense-MLP width (dense layers)
    shared_expert_intermediate_size: int  # 0 = no shared expert
    vocab_size: int  # V
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # Dh
    rope_theta: float
    rms_norm_eps: float
    norm_topk_prob: bool
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    clip_qkv: float | None = None
    max_position_embeddings: int = 4096
    sliding_window: int | None = None  # a query at p sees keys (p - sliding_window, p]; None = all
    layer_windows: tuple[int | None, ...] = ()  # per decoder layer: its sliding window (None = full attention)
    rope_scaling: dict | None = field(default=None, compare=False)  # the 'yarn' rope parameters; None: default
    expert_activation: ClampedSwiGLU | None = None  # gpt-oss; None: silu(gate) * up
    expert_bias: bool = False  # routed experts have gate_up [E, 2I] and down [E, D] biases
    extra: dict = field(default_factory=dict, compare=False, repr=False)  # the raw config

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layer_ids)

    @property
    def renormalize(self) -> bool:
        """Whether the top-k router weights are renormalised to sum to 1."""
        return self.traits.router_norm is RouterNorm.ALWAYS or self.norm_topk_prob

    def window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window (None: it attends to every earlier position)."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    def moe_ordinal(self, layer: int) -> int | None:
        """MoE-layer ordinal (index into ExpertBanks.layers) of decoder layer ``layer``; None if dense."""
        try:
            return self.moe_layer_ids.index(layer)
        except ValueError:
            return None

    def expert_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one routed expert (gate + up + down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * _itemsize(dtype)

    def active_weight_nbytes(self, dtype: torch.dtype) -> int:
        """Weight bytes one decode token reads: attention, norms, router, dense/shared MLPs, the A
        routed experts of each MoE layer and the LM head (the embedding row read is negligible)."""
        D, H, K, Dh = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = D * (H * Dh) * 2 + D * (K * Dh) * 2
        per_layer = attn + 2 * D
        total = self.num_layers * per_layer + self.vocab_size * D + D
        dense_layers = self.num_layers - self.num_moe_layers
        total += dense_layers * 3 * D * self.intermediate_size
        moe = D * self.num_experts + self.top_k * 3 * D * self.moe_intermediate_size
        moe += 3 * D * self.shared_expert_intermediate_size + (D if self.traits.shared_expert else 0)
        total += self.num_moe_layers * moe
        return total * _itemsize(dtype)

    @staticmethod
    def from_hf_config(cfg: dict, source: str = "config.json") -> "ModelSpec":
        """Normalise a Hugging Face ``config.json`` dict. ``source`` names the file in errors."""
        model_type = cfg.get("model_type")
        if model_type not in ARCHITECTURES:
            raise LoaderError(f"{source}: unsupported model_type {model_type!r} "
                              f"(supported: {supported_model_types()})")
        traits = ARCHITECTURES[model_type]

        def need(key: str):
            if cfg.get(key) is None:
                raise LoaderError(f"{source}: missing key {key!r} (model_type {model_type})")
            return cfg[key]

        num_layers = int(need("num_hidden_layers"))
        num_experts = next((int(cfg[k]) for k in _EXPERT_COUNT_KEYS if cfg.get(k)), 0)
        if num_experts <= 0:
            raise LoaderError(f"{source}: no expert count ({' or '.join(_EXPERT_COUNT_KEYS)}) in a MoE config")
        top_k = int(need("num_experts_per_tok"))
        if not 0 < top_k <= num_experts:
            raise LoaderError(f"{source}: num_experts_per_tok={top_k} must be in [1, {num_experts}]")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        head_dim = cfg.get("head_dim") or hidden // num_heads
        moe_layer_ids = _moe_layers(cfg, traits, num_layers)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE:
            raise LoaderError(f"{source}: rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE)})")
        missing = [k for k in ("factor", "original_max_position_embeddings") if rope_type == "yarn" and k not in rope]
        if missing:
            raise LoaderError(f"{source}: rope_type 'yarn' needs {' and '.join(repr(k) for k in missing)}")
        qkv_bias = bool(cfg.get(traits.qkv_bias_key, traits.qkv_bias_default)) if traits.qkv_bias_key else False
        if cfg.get("use_sliding_window"):  # Qwen's per-layer windows (max_window_layers): not implemented
            raise LoaderError(f"{source}: use_sliding_window=true is not supported")
        rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        window = int(cfg["sliding_window"]) if traits.sliding_window and cfg.get("sliding_window") else None
        gpt_oss = traits.expert_layout is ExpertLayout.GPT_OSS
        return ModelSpec(
            model_type=model_type,
            traits=traits,
            num_layers=num_layers,
            moe_layer_ids=moe_layer_ids,
            num_experts=num_experts,
            top_k=top_k,
            hidden_size=hidden,
            moe_intermediate_size=int(need(traits.expert_intermediate_key)),
            intermediate_size=int(cfg.get("intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
            if traits.shared_expert else 0,
            vocab_size=int(need("vocab_size")),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", traits.default_norm_topk_prob)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=qkv_bias and traits.o_bias,
            clip_qkv=cfg.get("clip_qkv") if traits.clip_qkv else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 4096),
            sliding_window=window,
            layer_windows=_layer_windows(cfg, traits, num_layers, window, source),
            rope_scaling=dict(rope) if rope_type == "yarn" else None,
            expert_activation=ClampedSwiGLU(float(cfg.get("swiglu_alpha", 1.702)), float(cfg.get("swiglu_limit", 7.0)))
            if gpt_oss else None,
            expert_bias=gpt_oss,
            extra=dict(cfg),
        )


def _moe_layers(cfg: dict, traits: ArchTraits, num_layers: int) -> tuple[int, ...]:
    """Which decoder layers are sparse: all, or (Qwen) those not in mlp_only_layers whose
    (index + 1) is a multiple of decoder_sparse_step — the rule of transformers' decoder layer."""
    if not traits.sparse_step:
        return tuple(range(num_layers))
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def _layer_windows(cfg: dict, traits: ArchTraits, num_layers: int, window: int | None,
                   source: str) -> tuple[int | None, ...]:
    """Per decoder layer, its window: from config.layer_types (gpt-oss; transformers' default when absent:
    even layers sliding, odd layers full), else ``window`` for every layer."""
    if not traits.layer_types:
        return (window,) * num_layers
    types = cfg.get("layer_types") or [SLIDING_LAYER if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers:
        raise LoaderError(f"{source}: layer_types has {len(types)} entries for {num_layers} layers")
    size = cfg.get("sliding_window")
    if any(t == SLIDING_LAYER for t in types) and not size:
        raise LoaderError(f"{source}: layer_types has sliding layers but sliding_window is not set")
    return tuple(int(size) if t == SLIDING_LAYER else None for t in types)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

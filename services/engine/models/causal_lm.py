"""MoECausalLM: the decoder stack shared by every supported architecture (differences come from
``spec.traits``). Parameter names equal the Hub tensor names, so the loader copies by name; routed
experts are not parameters here (they live in ExpertBanks and are computed by an ExpertBackend).

Legend: T tokens in the step · B sequences · D hidden · V vocab.
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models.attention import Attention
from services.engine.models.mlp import DenseMLP
from services.engine.models.norm import RMSNorm
from services.engine.models.rope import Rotary
from services.engine.models.spec import ModelSpec
from services.engine.moe.backends import ExpertBackend
from services.engine.moe.layer import MoEBlock
from services.engine.moe.routing_presets import SyntheticRouting
from services.engine.runtime.kv_cache import ForwardBatch, KVCache, upload
from services.engine.runtime.routing_trace import RoutingRecorder


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(spec, layer)
        moe_layer = spec.moe_ordinal(layer)
        if moe_layer is None:
            self.mlp_name = "mlp"
            self.add_module("mlp", DenseMLP(spec.hidden_size, spec.intermediate_size))
        else:
            self.mlp_name = spec.traits.moe_prefix  # "mlp", or "block_sparse_moe" for Mixtral
            self.add_module(self.mlp_name, MoEBlock(spec, moe_layer))
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.mlp_name)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions, cos, sin, batch: ForwardBatch,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm residual blocks, with each residual add fused into the norm after it: h [T, D] is the
        previous block's output and ``residual`` [T, D] the stream before it (None for the first
        layer: h is the embedding). Returns (this layer's FFN output, residual); the stream is their sum."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        a = self.self_attn(x, positions, cos, sin, batch, kv)
        x, residual = self.post_attention_layernorm(a, residual)
        return self.ffn(x), residual


class DecoderStack(nn.Module):
    """The ``model.`` prefix of the Hub names: embeddings, layers, final norm."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class MoECausalLM(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.model = DecoderStack(spec)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(spec.head_dim, spec.rope_theta, spec.rope_scaling)
        self.routing: SyntheticRouting | None = None  # a synthetic model's routing preset (set_routing)
        self.recorder: RoutingRecorder | None = None  # --record-routing (set_recorder)

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.ffn for layer in self.model.layers if isinstance(layer.ffn, MoEBlock)]

    def set_backend(self, backend: ExpertBackend) -> None:
        """Attach the expert backend every MoE block hands its routed experts to."""
        for block in self.moe_blocks():
            block.backend = backend

    def set_routing(self, routing: SyntheticRouting) -> None:
        """Let a routing preset's process pick every MoE block's experts (synthetic models only)."""
        self.routing = routing
        for block in self.moe_blocks():
            block.synthetic = routing

    def set_recorder(self, recorder: RoutingRecorder | None) -> None:
        """Hand every MoE block's expert ids to ``recorder`` (a routing trace; None stops)."""
        self.recorder = recorder
        for block in self.moe_blocks():
            block.recorder = recorder

    @property
    def backend(self) -> ExpertBackend | None:
        blocks = self.moe_blocks()
        return blocks[0].backend if blocks else None

    def non_expert_nbytes(self) -> int:
        """Bytes of the parameters held by this module (everything but the routed experts)."""
        return sum(p.numel() * p.element_size() for p in {id(p): p for p in self.parameters()}.values())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                kv: KVCache) -> torch.Tensor:
        """input_ids [T] int64 · positions [T] int64 (tokens of each sequence contiguous, as in
        ``batch``) -> logits [B, V] fp32 at each sequence's last new token."""
        if input_ids.shape[0] != batch.num_tokens or positions.shape[0] != batch.num_tokens:
            raise ValueError(f"forward: input_ids [{input_ids.shape[0]}] and positions [{positions.shape[0]}] "
                             f"must both have the batch's {batch.num_tokens} tokens")
        kv.check(batch)  # a bad slot/position would otherwise be a device-side assert on CUDA
        h = self.model.embed_tokens(input_ids)  # [T, D]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, Dh] each
        if self.routing is not None:  # decode: the graph's static slot tensor; prefill: the packed batch's
            slots = batch.slot_tensor(h.device) if batch.is_decode else batch.packed(h.device).tok_slot
            self.routing.begin(positions, slots)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, positions, cos, sin, batch, kv)
        if not batch.is_decode:  # decode: token i is sequence i's last token already
            last = upload(batch.last_token_index(), h.device)  # no sync: the host goes on to sample
            h, residual = h[last], residual[last]  # [B, D]
        h, _ = self.model.norm(h, residual)
        return self.lm_head(h).float()  # [B, V]

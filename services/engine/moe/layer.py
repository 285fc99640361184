"""The MoE block: router -> expert backend (+ Qwen2-MoE's gated shared expert).

Legend: T tokens · E experts · A experts per token · D hidden.

The block owns only the router (and the shared expert); routed expert weights live in the banks and
are computed by whichever ExpertBackend the engine attached (resident, offload, cpu, hybrid). Tensor
names match the Hub (``<prefix>.gate.weight`` or gpt-oss's ``mlp.router.weight``/``bias``, ``<prefix>.shared_expert.*``, ``shared_expert_gate``).
"""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models import fused
from services.engine.models.mlp import DenseMLP
from services.engine.models.spec import ModelSpec
from services.engine.moe.backends import ExpertBackend
from services.engine.moe.routing_presets import SyntheticRouting
from services.engine.runtime.routing_trace import RoutingRecorder


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing, as transformers does it.

    router_logits [T, E] -> (topk_weights [T, A] fp32, topk_ids [T, A] int64). With ``renormalize``
    the A weights are divided by their sum (``norm_topk_prob``; for Mixtral this equals a softmax over
    the top-k logits). On CUDA this is one kernel (kernels/route_topk.py), here five.
    """
    if router_logits.dim() == 2 and router_logits.stride(-1) == 1:  # one Triton launch on CUDA
        got = fused.call("route_topk", "route_topk", "route_topk", router_logits, top_k, renormalize)
        if got is not None:
            return got
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, A], [T, A]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class MoEBlock(nn.Module):
    def __init__(self, spec: ModelSpec, moe_layer: int) -> None:
        super().__init__()
        D, E = spec.hidden_size, spec.num_experts
        self.moe_layer = moe_layer  # ordinal into ExpertBanks.layers
        self.top_k = spec.top_k
        self.renormalize = spec.renormalize
        self.router_name = spec.traits.router_name  # the Hub's name: "gate", gpt-oss "router"
        self.add_module(self.router_name, nn.Linear(D, E, bias=spec.traits.router_bias))
        self.has_shared = spec.traits.shared_expert and spec.shared_expert_intermediate_size > 0
        if self.has_shared:
            self.shared_expert = DenseMLP(D, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(D, 1, bias=False)
        self.backend: ExpertBackend | None = None  # attached by MoECausalLM.set_backend
        # a routing preset's process picks the experts instead of the router's top-k (MoECausalLM.set_routing)
        self.synthetic: SyntheticRouting | None = None
        self.recorder: RoutingRecorder | None = None  # --record-routing: each call's expert ids (MoECausalLM.set_recorder)

    @property
    def router_linear(self) -> nn.Linear:
        """The router linear [E, D] (+ bias [E] for gpt-oss)."""
        return self._modules[self.router_name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        router = self.router_linear
        logits = fused.linear(x, router.weight, router.bias)  # [T, E]
        if self.synthetic is not None:
            topk_weights, topk_ids = self.synthetic.route(self.moe_layer, logits)  # [T, A] fp32, int64
        else:
            topk_weights, topk_ids = route(logits, self.top_k, self.renormalize)
        if self.recorder is not None:
            self.recorder.record(self.moe_layer, topk_ids)
        if self.backend is None:
            raise RuntimeError("MoEBlock has no expert backend; call MoECausalLM.set_backend(...) first")
        out = self.backend.forward(self.moe_layer, x, topk_ids, topk_weights)  # [T, D]
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

"""Pure-torch reference of the routed-expert computation. Every backend and kernel is checked against
this (and this against Hugging Face transformers through the model parity tests).

Legend: N rows · T tokens · A experts per token · E experts · D hidden · I expert intermediate.

Two activations: the SwiGLU of Qwen/Mixtral/OLMoE, ``silu(gate) * up``, and gpt-oss's clamped form
(``ClampedSwiGLU``), whose experts also have biases: ``gate_up_bias [E, 2I]`` (gate rows first, like the
bank) and ``down_bias [E, D]``, added before the activation and before the routing weight.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss (transformers ``GptOssExperts._apply_gate``): gate clamped above at ``limit``, up to
    [-limit, limit], then ``(up + 1) * gate * sigmoid(alpha * gate)``."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def glu(h: torch.Tensor, act: ClampedSwiGLU | None = None) -> torch.Tensor:
    """h [..., 2I] (gate then up) -> [..., I]: ``act(gate, up)``, or ``silu(gate) * up`` when None."""
    I = h.shape[-1] // 2
    gate, up = h[..., :I], h[..., I:]
    return F.silu(gate) * up if act is None else act(gate, up)


def expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """One expert on rows ``x [N, D]`` with ``gate_up [2I, D]`` and ``down [D, I]`` (optional biases
    ``gate_up_bias [2I]``, ``down_bias [D]``) -> ``[N, D]``. ``inputs``: what both GEMVs see of their input
    rows, for kernels that round them (gguf_quant.q8_inputs: the CPU executor's int8 inputs)."""
    seen = inputs or (lambda v: v)
    h = seen(x) @ gate_up.t()  # [N, 2I]
    if gate_up_bias is not None:
        h = h + gate_up_bias
    y = seen(glu(h, act)) @ down.t()  # [N, D]
    return y if down_bias is None else y + down_bias


def moe_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                  bias: tuple[torch.Tensor, torch.Tensor] | None = None,
                  inputs: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Routed experts of one layer.

    hidden [T, D] · topk_ids [T, A] (int, -1 = route computed elsewhere, skipped) ·
    topk_weights [T, A] · gate_up [E, 2I, D] · down [E, D, I] · bias: (gate_up_bias [E, 2I],
    down_bias [E, D]) or None · inputs: as expert_swiglu's  ->  out [T, D] (accumulated in fp32, returned in
    hidden's dtype).
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # routes to expert e
        b_gu, b_d = (bias[0][e], bias[1][e]) if bias is not None else (None, None)
        y = expert_swiglu(hidden[tok], gate_up[e], down[e], act, b_gu, b_d, inputs).float()  # [N, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(hidden.dtype)

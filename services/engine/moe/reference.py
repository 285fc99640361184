"""Pure-torch reference of the routed-expert computation. Every backend and kernel is checked against
this (and this against Hugging Face transformers through the model parity tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expert_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One expert on rows ``x [N, D]`` with ``gate_up [2I, D]`` and ``down [D, I]`` -> ``[N, D]``."""
    I = down.shape[1]
    h = x @ gate_up.t()  # [N, 2I]
    return (F.silu(h[:, :I]) * h[:, I:]) @ down.t()  # [N, D]


def moe_reference(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Routed experts of one layer.

    hidden [T, D] · topk_ids [T, A] (int, -1 = route computed elsewhere, skipped) ·
    topk_weights [T, A] · gate_up [E, 2I, D] · down [E, D, I]  ->  out [T, D] (accumulated in fp32,
    returned in hidden's dtype).
    """
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in torch.unique(topk_ids).tolist():
        if e < 0:
            continue
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)  # routes to expert e
        y = expert_swiglu(hidden[tok], gate_up[e], down[e]).float()  # [N, D]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(hidden.dtype)

"""The dense SwiGLU MLP: dense decoder layers and Qwen2-MoE's shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.engine.models.fused import LinearGroup


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = LinearGroup(self.gate_proj, self.up_proj)  # one [2 * inter, hidden] matmul
        self.inter = intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]."""
        gate_up = self.gate_up(x)  # [T, 2 * inter]
        return self.down_proj(F.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:])

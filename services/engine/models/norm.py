"""RMSNorm, computed the way Hugging Face computes it (fp32 statistics, weight applied in the input
dtype) so fp32 logits match transformers to ~1e-6. Optionally fused with the residual add before it
(``residual`` argument): one Triton launch on CUDA (kernels/rmsnorm.py) instead of 9 torch kernels."""

from __future__ import annotations

import torch
from torch import nn

from services.engine.models import fused


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x [..., size] -> [..., size] (same dtype). With ``residual`` [..., size]: returns
        (norm(x + residual), x + residual), the sum rounded to x's dtype as a torch add would."""
        if x.dim() == 2 and x.stride(-1) == 1:
            got = fused.call("rmsnorm", "rmsnorm", "rms_norm", x, self.weight, self.eps, residual)
            if got is not None:
                return got if residual is not None else got[0]
        if residual is not None:
            x = x + residual
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * h.to(dtype)
        return (out, x) if residual is not None else out

"""Rotary position embedding (the "default" rope of Llama/Qwen/Mixtral/OLMoE: rotate-half layout).

cos/sin are computed from the positions tensor on the fly (a [T, Dh] outer product), not from a
table: no max-positions-sized buffer, and it stays capturable in a CUDA graph (positions live on the
device)."""

from __future__ import annotations

import torch


class Rotary:
    def __init__(self, head_dim: int, theta: float) -> None:
        # Same formula and order of operations as transformers' default rope init (fp32 on the CPU),
        # so cos/sin agree bit for bit in fp32.
        exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
        self.inv_freq = 1.0 / (theta ** exponent)  # [Dh/2]
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, Dh] in ``dtype``."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] · cos/sin [T, Dh] -> [T, heads, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

"""Rotary position embedding (rotate-half layout): the "default" rope of Llama/Qwen/Mixtral/OLMoE and
gpt-oss's "yarn" (inverse frequencies blended between interpolated and extrapolated, cos/sin scaled by
an attention factor).

cos/sin are computed from the positions tensor on the fly (a [T, Dh] outer product), not from a
table: no max-positions-sized buffer, and it stays capturable in a CUDA graph (positions live on the
device)."""

from __future__ import annotations

import math

import torch


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """[Dh/2]: same formula and order of operations as transformers' default rope init (fp32 on the
    CPU), so cos/sin agree bit for bit in fp32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta ** exponent)


def yarn_inv_freq(head_dim: int, theta: float, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' ``_compute_yarn_parameters`` computes it, for the keys
    gpt-oss configs use (factor, beta_fast, beta_slow, original_max_position_embeddings, truncate,
    optional attention_factor / mscale / mscale_all_dim). Returns (inv_freq [Dh/2], attention factor)."""
    factor = float(params["factor"])
    original_max = params["original_max_position_embeddings"]

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = (float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all)) if mscale and mscale_all
                            else get_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original_max / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # transformers: prevent a division by zero
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)  # cpu: models build on meta
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency (high-frequency dims)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary:
    def __init__(self, head_dim: int, theta: float, scaling: dict | None = None) -> None:
        """``scaling``: the config's rope parameters when rope_type is 'yarn' (None: default rope)."""
        if scaling is None:
            self.inv_freq, self.attention_factor = default_inv_freq(head_dim, theta), 1.0  # [Dh/2]
        else:
            self.inv_freq, self.attention_factor = yarn_inv_freq(head_dim, theta, scaling)
        self._on_device: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, Dh] in ``dtype``."""
        inv_freq = self._on_device.get(positions.device)
        if inv_freq is None:
            inv_freq = self._on_device.setdefault(positions.device, self.inv_freq.to(positions.device))
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, Dh]
        if self.attention_factor == 1.0:
            return emb.cos().to(dtype), emb.sin().to(dtype)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, Dh] · cos/sin [T, Dh] -> [T, heads, Dh]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

"""gpt-oss routed experts from a Hub checkpoint into the engine's banks.

Hub layout per MoE layer (prefix ``model.layers.N.mlp.experts.``), MXFP4 as published:
    gate_up_proj_blocks uint8 [E, 2I, D/32, 16] · gate_up_proj_scales uint8 [E, 2I, D/32]
    down_proj_blocks    uint8 [E, D, I/32, 16]  · down_proj_scales    uint8 [E, D, I/32]
    gate_up_proj_bias [E, 2I] · down_proj_bias [E, D]      (bf16)
or, unquantized (transformers' ``save_pretrained`` of a dequantized model), ``gate_up_proj`` [E, D, 2I] and
``down_proj`` [E, I, D] (transformers' [in, out] parameters).

The 2I outputs of gate_up interleave gate and up (gate = even columns, up = odd, transformers'
``gate_up[..., ::2]`` / ``[..., 1::2]``); the bank keeps the engine's layout, rows [0, I) gate and [I, 2I)
up, so the loader de-interleaves rows and bias alike. MXFP4 experts go into ``mxfp4`` banks as they are
(per row the 16-byte blocks flattened to [R, C/2] and the scales [R, C/32]: whole rows move, no value
changes); into unquantized banks (``--moe-expert-dtype dtype``, or an unquantized checkpoint) they are
dequantized one expert at a time (models/mxfp4.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from services.engine.models import mxfp4
from services.engine.models.errors import LoaderError
from services.engine.models.spec import ModelSpec
from services.engine.moe.banks import ExpertFormat, LayerBanks


def _prefix(spec: ModelSpec, layer: int) -> str:
    return f"model.layers.{layer}.{spec.traits.moe_prefix}.experts."


def is_mxfp4(ckpt, spec: ModelSpec, layer: int) -> bool:
    return _prefix(spec, layer) + "gate_up_proj_blocks" in ckpt


def num_steps(spec: ModelSpec) -> int:
    """Progress steps of all layers' experts: per expert gate_up and down, plus the two biases per layer."""
    return spec.num_moe_layers * (2 * spec.num_experts + 2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[2I, ...] rows gate0, up0, gate1, up1, ... -> [2I, ...] gate rows then up rows."""
    return torch.cat([t[0::2], t[1::2]])


def load_layer(ckpt, spec: ModelSpec, layer: int, banks: LayerBanks, step: Callable[[], None]) -> None:
    """Fill ``banks`` (gate_up [E, 2I, D], down [E, D, I], gate_up_bias [E, 2I], down_bias [E, D]; in the
    mxfp4 format gate_up [E, 2I, D/2], down [E, D, I/2] and their E8M0 scales) with decoder layer
    ``layer``'s experts; ``step()`` after each expert projection and each bias."""
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    p = _prefix(spec, layer)
    gate_up, down = banks.tensors["gate_up"], banks.tensors["down"]
    dtype = gate_up.dtype
    if banks.format is ExpertFormat.MXFP4:
        if not is_mxfp4(ckpt, spec, layer):
            raise LoaderError(f"MoE layer {layer}: mxfp4 expert banks need the checkpoint's {p}gate_up_proj_blocks "
                              "(the config says quant_method mxfp4)")
        G_d, G_i = D // mxfp4.BLOCK, I // mxfp4.BLOCK
        src = {"gate_up": ckpt.get(p + "gate_up_proj_blocks", (E, 2 * I, G_d, 16)).flatten(-2),  # [E, 2I, D/2]
               "gate_up_scale": ckpt.get(p + "gate_up_proj_scales", (E, 2 * I, G_d)),
               "down": ckpt.get(p + "down_proj_blocks", (E, D, G_i, 16)).flatten(-2),  # [E, D, I/2]
               "down_scale": ckpt.get(p + "down_proj_scales", (E, D, G_i))}
        for name, t in src.items():
            if t.dtype != torch.uint8:
                raise LoaderError(f"MoE layer {layer}: {p}{name.replace('gate_up', 'gate_up_proj').replace('down', 'down_proj')}"
                                  f" is {t.dtype}; MXFP4 blocks and scales are uint8")
        t = banks.tensors
        for e in range(E):  # one expert at a time: the loader's progress
            t["gate_up"][e].copy_(_deinterleave(src["gate_up"][e]))
            t["gate_up_scale"][e].copy_(_deinterleave(src["gate_up_scale"][e]))
            step()
            t["down"][e].copy_(src["down"][e])
            t["down_scale"][e].copy_(src["down_scale"][e])
            step()
    elif is_mxfp4(ckpt, spec, layer):
        G_d, G_i = D // mxfp4.BLOCK, I // mxfp4.BLOCK
        gu_blocks = ckpt.get(p + "gate_up_proj_blocks", (E, 2 * I, G_d, 16))
        gu_scales = ckpt.get(p + "gate_up_proj_scales", (E, 2 * I, G_d))
        d_blocks = ckpt.get(p + "down_proj_blocks", (E, D, G_i, 16))
        d_scales = ckpt.get(p + "down_proj_scales", (E, D, G_i))
        for e in range(E):
            gate_up[e].copy_(_deinterleave(mxfp4.dequantize(gu_blocks[e], gu_scales[e], dtype)))  # [2I, D]
            step()
            down[e].copy_(mxfp4.dequantize(d_blocks[e], d_scales[e], dtype))  # [D, I]
            step()
    else:
        gu = ckpt.get(p + "gate_up_proj", (E, D, 2 * I))  # [E, D, 2I]
        d = ckpt.get(p + "down_proj", (E, I, D))  # [E, I, D]
        for e in range(E):
            gate_up[e].copy_(_deinterleave(gu[e].t()))
            step()
            down[e].copy_(d[e].t())
            step()
    banks.tensors["gate_up_bias"].copy_(_deinterleave(ckpt.get(p + "gate_up_proj_bias", (E, 2 * I)).t()).t())
    step()
    banks.tensors["down_bias"].copy_(ckpt.get(p + "down_proj_bias", (E, D)))
    step()

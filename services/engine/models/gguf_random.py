"""Random GGUF blocks: valid quantized rows of a given type whose values spread like N(0, std), for the
synthetic models' expert banks (``synthetic:NAME?experts=q4_K``), the benchmark GGUF writer
(benchmarks/write_gguf.py) and the tests' tiny GGUF files.

Why random bytes and not quantized random floats: the gguf package quantizes only q8_0 and mxfp4 (its K
types dequantize only), and a quantizer run over 29 G values (Qwen3-30B-A3B's experts) takes minutes
where random bytes take seconds. Every byte of a block is uniform random except its fp16 scale fields
(``d``, and ``dmin`` for the K types with minimums), set so the values have the wanted spread: the
quantized codes and sub-block scales are then uniform, so a kernel meets every code. MXFP4's E8M0 scale
byte is one power of two per tensor. The spread is measured on 64 blocks through the dequantizer
(moe/gguf_quant.py), once per type.
"""

from __future__ import annotations

import functools
import math

import torch

from services.engine.moe.gguf_quant import BLOCK, GGUFType, dequantize

# per type: byte offset of the fp16 d, of the fp16 dmin (None: no minimum), and the mean code the minimum
# cancels (the codes' mean times the mean sub-block scale: values centred on 0 on average); mxfp4: the E8M0 byte
_FIELDS: dict[str, tuple[int, int | None]] = {"q4_K": (0, 2), "q5_K": (0, 2), "q6_K": (208, None), "q8_0": (0, None)}
_MEAN_CODE = {"q4_K": 7.5, "q5_K": 15.5}  # dmin = d * mean code: the unsigned codes' mean (sub-block min ~ scale)
MXFP4_SCALE_BYTE = 0  # GGUF's MXFP4 block: one E8M0 byte, then 16 bytes of e2m1 pairs


def _set_scales_(blocks: torch.Tensor, qtype: str, d: float) -> None:
    """Write the scale fields of every block of ``blocks`` uint8 [..., block bytes] (d, dmin; mxfp4: the
    exponent byte of 2**round(log2 d))."""
    if qtype == "mxfp4_gguf":
        blocks[..., MXFP4_SCALE_BYTE] = max(0, min(254, 127 + round(math.log2(d))))
        return
    d_off, dmin_off = _FIELDS[qtype]
    half = lambda x: torch.tensor([x], dtype=torch.float16).view(torch.uint8)  # noqa: E731 - 2 bytes, little-endian
    blocks[..., d_off:d_off + 2] = half(d).to(blocks.device)
    if dmin_off is not None:
        blocks[..., dmin_off:dmin_off + 2] = half(d * _MEAN_CODE[qtype]).to(blocks.device)


@functools.cache
def _unit_std(qtype: str) -> float:
    """Standard deviation of the values of random blocks with d = 1 (64 blocks, fixed seed)."""
    n, nbytes = BLOCK[GGUFType(qtype)]
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (64, nbytes), dtype=torch.uint8, generator=gen)
    _set_scales_(blocks, qtype, 1.0)
    return float(dequantize(blocks, qtype, n).std())


def random_blocks_(out: torch.Tensor, qtype: str, std: float, gen: torch.Generator) -> torch.Tensor:
    """Fill ``out`` uint8 [..., row bytes] (whole blocks per row) in place with random blocks of ``qtype``
    whose values have standard deviation ~``std`` (mxfp4: within a factor sqrt(2)); returns ``out``."""
    qtype = GGUFType(qtype).value
    nbytes = BLOCK[GGUFType(qtype)][1]
    if out.shape[-1] % nbytes:
        raise ValueError(f"random {qtype} blocks: a row of {out.shape[-1]} bytes is not whole {nbytes}-byte blocks")
    blocks = out.view(*out.shape[:-1], -1, nbytes)
    if out.device.type == gen.device.type:
        blocks.random_(0, 256, generator=gen)
    else:
        blocks.copy_(torch.randint(0, 256, blocks.shape, dtype=torch.uint8, generator=gen, device=gen.device))
    _set_scales_(blocks, qtype, std / _unit_std(qtype))
    return out


# Expert type mixes of the synthetic models and the benchmark GGUF writer, by name: a single type for every
# expert tensor, or llama.cpp's _M mixes. For Q4_K_M / Q5_K_M llama.cpp (src/llama-quant.cpp) keeps
# gate/up in q4_K / q5_K and gives ffn_down q6_K in the layers ``use_more_bits`` picks (the first and last
# eighth, and every third between), its base type elsewhere; the same rule here (approximately what
# llama.cpp does: it also adjusts attention tensors, which the engine dequantizes anyway).
SINGLE_TYPES = ("q4_K", "q5_K", "q6_K", "q8_0", "mxfp4_gguf")
MIXES = {"q4_K_M": "q4_K", "q5_K_M": "q5_K"}


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's rule for the layers whose ffn_down gets q6_K in a _M mix."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def layer_types(mix: str, num_layers: int) -> list[tuple[str, str]]:
    """Per MoE layer, the (gate/up, down) GGUF types of mix ``mix`` (ValueError naming the mixes)."""
    if mix in SINGLE_TYPES:
        return [(mix, mix)] * num_layers
    if mix in MIXES:
        base = MIXES[mix]
        return [(base, "q6_K" if use_more_bits(i, num_layers) else base) for i in range(num_layers)]
    raise ValueError(f"unknown GGUF expert types {mix!r} (one of {', '.join(SINGLE_TYPES + tuple(MIXES))})")

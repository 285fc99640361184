"""Expert weights in a plain dtype whatever their bank format: the torch compute paths' (resident.py) and
``--moe-expert-dtype dtype``'s one dispatch on the format. Dispatch goes by the bank format, never by
which scale banks exist: fp8_block's scales are fp32 per 128x128 block, mxfp4's are E8M0 bytes per 32
values of a row, and both banks are called ``gate_up_scale`` / ``down_scale``.

Legend: E experts · D hidden · I expert intermediate.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from tqdm import tqdm

from services.common.logging import get_logger
from services.engine.models import mxfp4
from services.engine.moe import fp8
from services.engine.moe import gguf_quant
from services.engine.moe.banks import BANK_SCHEMAS, GGUF_TYPES, ExpertFormat, host_bank

log = get_logger("moe.dequant")

# the weight and scale dtypes of each quantized format (what the banks must hold)
_DTYPES = {ExpertFormat.FP8_BLOCK: (fp8.FP8_DTYPE, torch.float32), ExpertFormat.MXFP4: (torch.uint8, torch.uint8)}


def check_banks(fmt: ExpertFormat, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
                down_scale: torch.Tensor | None) -> ExpertFormat:
    """``fmt`` when the tensors are what it says (weight and scale dtypes, scales given exactly for the
    quantized formats), else ValueError: kernels that tell formats by dtype (kernels/moe_gemv.py) then
    agree with the format."""
    fmt = ExpertFormat(fmt)
    if fmt in GGUF_TYPES:
        if gate_up_scale is not None or down_scale is not None:
            raise ValueError(f"{fmt.value} expert banks carry their scales in their blocks: no scale banks")
        if gate_up.dtype != torch.uint8 or down.dtype != torch.uint8:
            raise ValueError(f"{fmt.value} expert banks are uint8 blocks, got {gate_up.dtype} and {down.dtype}")
        return fmt
    if fmt is ExpertFormat.UNQUANTIZED:
        if gate_up_scale is not None or down_scale is not None:
            raise ValueError("unquantized expert banks come without scale banks")
        if not gate_up.is_floating_point() or gate_up.element_size() < 2:
            raise ValueError(f"unquantized expert banks must be bf16/fp16/fp32, got {gate_up.dtype} "
                             "(quantized banks need their format)")
        return fmt
    if gate_up_scale is None or down_scale is None:
        raise ValueError(f"{fmt.value} expert banks need gate_up_scale and down_scale")
    w_dtype, s_dtype = _DTYPES[fmt]
    got = (gate_up.dtype, down.dtype, gate_up_scale.dtype, down_scale.dtype)
    if got != (w_dtype, w_dtype, s_dtype, s_dtype):
        raise ValueError(f"{fmt.value} expert banks are {w_dtype} weights with {s_dtype} scales, got "
                         f"{', '.join(str(d) for d in got)} (gate_up, down, gate_up_scale, down_scale)")
    return fmt


def dense_experts(fmt: ExpertFormat, gate_up: torch.Tensor, down: torch.Tensor, gate_up_scale: torch.Tensor | None,
                  down_scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [..., 2I, D], down [..., D, I]) in ``dtype`` from banks of format ``fmt`` (one expert or a
    stack; scales given exactly when the format has them). ValueError when the tensors are not what the
    format says (e.g. E8M0 bytes handed over as FP8 scales)."""
    fmt = check_banks(fmt, gate_up, down, gate_up_scale, down_scale)
    if fmt is ExpertFormat.UNQUANTIZED:
        return gate_up.to(dtype), down.to(dtype)
    if fmt is ExpertFormat.FP8_BLOCK:
        return fp8.dense_experts(gate_up, down, gate_up_scale, down_scale, dtype)
    if fmt in GGUF_TYPES:  # rows may be wider than the layer's types need (banks.bank_shapes): read their start
        (gu_type, down_type), D, I = GGUF_TYPES[fmt], down.shape[-2], gate_up.shape[-2] // 2
        return (gguf_quant.dequantize(gate_up[..., :gguf_quant.row_bytes(gu_type, D)], gu_type, D).to(dtype),
                gguf_quant.dequantize(down[..., :gguf_quant.row_bytes(down_type, I)], down_type, I).to(dtype))
    return mxfp4.dense_experts(gate_up, down, gate_up_scale, down_scale, dtype)


DEQUANT_CHUNK = 8  # experts dequantized together: ~0.8 GB of fp32 temporaries at gpt-oss's width


def dequantize_layers(layers, dtype: torch.dtype, progress: Callable[[dict], None] | None = None) -> None:
    """``--moe-expert-dtype dtype``: turn every quantized LayerBanks of ``layers`` into unquantized banks of
    ``dtype`` in place, one layer at a time (the quantized banks of a layer are freed as soon as its
    plain ones exist: the peak is one extra layer). ``progress`` gets ``{"phase": "dequantizing", "done",
    "total", "fraction"}`` after each layer."""
    todo = [layer for layer in layers if layer.format is not ExpertFormat.UNQUANTIZED]
    if not todo:
        return
    t0, fmt = time.perf_counter(), todo[0].format
    with tqdm(total=len(todo), desc=f"dequantizing {fmt.value} experts", unit="layer", leave=False) as bar:
        for done, layer in enumerate(todo, 1):
            t = layer.tensors
            E, D, I = t["down"].shape[0], t["down"].shape[1], t["gate_up"].shape[1] // 2  # rows: any format
            fresh = {}
            for spec in BANK_SCHEMAS[ExpertFormat.UNQUANTIZED]:
                shape = (E, *spec.shape(D, I))
                fresh[spec.name] = (host_bank(shape, dtype) if t["down"].device.type == "cpu"
                                    else torch.empty(shape, dtype=dtype, device=t["down"].device))
            for e in range(0, E, DEQUANT_CHUNK):
                c = slice(e, e + DEQUANT_CHUNK)
                scales = [t[name][c] if name in t else None for name in ("gate_up_scale", "down_scale")]
                gu, d = dense_experts(layer.format, t["gate_up"][c], t["down"][c], *scales, dtype)
                fresh["gate_up"][c].copy_(gu)
                fresh["down"][c].copy_(d)
            for name in ("gate_up_bias", "down_bias"):  # gpt-oss: the bias banks stay as they are
                if name in t:
                    fresh[name] = t[name]
            layer.format, layer.tensors = ExpertFormat.UNQUANTIZED, fresh
            bar.update(1)
            if progress is not None:
                progress({"phase": "dequantizing", "done": done, "total": len(todo), "fraction": done / len(todo)})
    log.info("%s experts dequantized to %s: %d layers in %.1f s", fmt.value, str(dtype).removeprefix("torch."),
             len(todo), time.perf_counter() - t0)

"""Which quantized checkpoints the loader reads: ``config.json``'s ``quantization_config`` -> the expert
bank format, or a LoaderError naming what is supported.

Supported: Hugging Face fine-grained FP8 (Qwen3-*-FP8, DeepSeek-V3 style), i.e.
``{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}``:
each quantized ``X.weight`` is float8_e4m3fn with ``X.weight_scale_inv`` (float32 or bfloat16) per
128x128 block, on a ceil grid (services/engine/moe/fp8.py). Modules the config leaves unquantized
(``modules_to_not_convert``: norms, routers, embeddings, lm_head) are stored plainly; which tensors are
FP8 is read from the files themselves (a weight with a ``weight_scale_inv`` beside it).

gpt-oss's MXFP4 experts (``quant_method`` mxfp4) load as they are into ``mxfp4`` banks by their own
loader (models/gpt_oss_experts.py); ``--moe-expert-dtype dtype`` dequantizes them at load instead.
"""

from __future__ import annotations

import torch

from services.engine.models.errors import LoaderError
from services.engine.moe.banks import ExpertFormat
from services.engine.moe.fp8 import BLOCK, FP8_DTYPE

SUPPORTED = ("fine-grained FP8: quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', "
             f"weight_block_size [{BLOCK}, {BLOCK}]")
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
SCALE_DTYPES = (torch.float32, torch.bfloat16)
# (model_type, quant_method) pairs whose experts their architecture's loader reads into the format given
ARCHITECTURE_FORMATS = {("gpt_oss", "mxfp4"): ExpertFormat.MXFP4}


def checkpoint_format(cfg: dict, source: str) -> ExpertFormat:
    """The bank format a checkpoint's experts load into (UNQUANTIZED without a quantization_config)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return ExpertFormat.UNQUANTIZED

    def refuse(what: str) -> LoaderError:
        return LoaderError(f"{source}: quantization_config {what} is not supported (supported: {SUPPORTED})")

    if not isinstance(qc, dict):
        raise refuse(f"of type {type(qc).__name__}")
    method = qc.get("quant_method")
    if (cfg.get("model_type"), method) in ARCHITECTURE_FORMATS:
        fmt = ARCHITECTURE_FORMATS[cfg.get("model_type"), method]
        D, I = cfg.get("hidden_size", 0), cfg.get("intermediate_size", 0)
        if fmt is ExpertFormat.MXFP4 and (D % 32 or I % 32):
            raise LoaderError(f"{source}: MXFP4 experts need hidden_size ({D}) and intermediate_size ({I}) to be "
                              "multiples of 32 (one E8M0 scale per 32 values)")
        return fmt
    if method != "fp8":
        raise refuse(f"quant_method {method!r}")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise refuse(f"fmt {qc.get('fmt')!r}")
    block = qc.get("weight_block_size")
    if block is None:
        raise refuse("without weight_block_size (per-tensor FP8 scales)")
    if list(block) != [BLOCK, BLOCK]:
        raise refuse(f"weight_block_size {list(block)}")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise refuse(f"activation_scheme {qc.get('activation_scheme')!r} (static activation scales)")
    return ExpertFormat.FP8_BLOCK


def scale_name(weight_name: str) -> str:
    return weight_name + SCALE_SUFFIX


def check_fp8_pair(where: str, name: str, q: torch.Tensor, scale: torch.Tensor) -> None:
    """A quantized weight and its scale as the format says, or a LoaderError naming the tensor."""
    if q.dtype != FP8_DTYPE:
        raise LoaderError(f"{where}: tensor {name!r} has a {SCALE_SUFFIX} but dtype {q.dtype} "
                          f"(supported: {SUPPORTED}, weights float8_e4m3fn)")
    if scale.dtype not in SCALE_DTYPES:
        raise LoaderError(f"{where}: tensor {scale_name(name)!r} has dtype {scale.dtype} "
                          "(supported: float32 or bfloat16 block scales)")

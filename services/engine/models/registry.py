"""load_model: the one entry point from an EngineConfig to a runnable model.

``config.model`` is a checkpoint directory, a GGUF file (``.gguf``, or one shard of a split one;
models/gguf_loader.py), ``demo`` (the demo checkpoint, written on first use) or
``synthetic:NAME[?layers=N]`` (random weights in memory). The result holds the spec, the module on the
device, the expert banks, the tokenizer directory and a model id; the configured expert backend is
attached (``model.set_backend``) unless ``attach_backend=False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from services.common.logging import get_logger
from services.engine.config import DType, EngineConfig, ExpertDType, MoEBackend
from services.engine.models.causal_lm import MoECausalLM
from services.engine.models.errors import LoaderError
from services.engine.models.gguf_reader import is_gguf
from services.engine.models.loader import load_checkpoint
from services.engine.models.spec import ModelSpec
from services.engine.models import synthetic
from services.engine.runtime.kv_budget import decide_kv_budget, prefill_workspace_bytes, resolve_max_seq_len
from services.engine.moe.backends import BackendContext, ExpertBackend, make_backend
from services.engine.moe.prefetch import next_layer_predictors
from services.engine.moe.banks import ExpertBanks, ExpertFormat, pin_banks  # noqa: F401 - pin_banks: re-exported
from services.engine.moe.dequant import dequantize_layers
from services.engine.moe.fp8 import quantize_layers

log = get_logger("registry")

TORCH_DTYPES: dict[DType, torch.dtype] = {DType.FLOAT32: torch.float32, DType.BFLOAT16: torch.bfloat16}
DEMO = "demo"


@dataclass
class LoadedModel:
    spec: ModelSpec
    model: MoECausalLM  # on config.device
    banks: ExpertBanks  # host banks (synthetic + resident on CUDA: on the device, see synthetic.py)
    model_dir: Path  # tokenizer.json, tokenizer_config.json, generation_config.json
    model_id: str
    device: torch.device
    dtype: torch.dtype

    @property
    def backend(self) -> ExpertBackend | None:
        return self.model.backend


def torch_device(config: EngineConfig) -> torch.device:
    device = torch.device(config.device.value)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (use --device cpu)")
    return device


def _tokenizer_vocab(model_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()


def load_model(config: EngineConfig, progress: Callable[[dict], None] | None = None,
               attach_backend: bool = True) -> LoadedModel:
    """Load ``config.model`` onto ``config.device`` in ``config.dtype`` and attach the configured
    expert backend. ``progress`` gets dicts like ``{"phase": "loading", "done": n, "total": N,
    "fraction": f}`` (for /health). Raises LoaderError on a bad checkpoint."""
    device, dtype = torch_device(config), TORCH_DTYPES[config.dtype]
    if synthetic.is_synthetic(config.model):
        model_dir = synthetic.tokenizer_dir(config.model)
        # Resident on CUDA keeps the banks on the GPU from the start: no 2x60 GB host round trip.
        on_device = config.moe_backend is MoEBackend.RESIDENT and device.type == "cuda"
        spec, model, banks = synthetic.build_synthetic(
            config.model, _tokenizer_vocab(model_dir), device, dtype, config.seed,
            banks_device=device if on_device else None, progress=progress)
        model_id = config.model
    elif is_gguf(config.model):
        spec, model, banks, model_dir, model_id = _load_gguf(config.model, device, dtype, progress)
    else:
        if config.model == DEMO:
            from services.engine.models.demo import ensure_demo_checkpoint

            model_dir, model_id = ensure_demo_checkpoint(config.seed), "tandem-demo"
        else:
            model_dir = Path(config.model).expanduser()
            if not model_dir.is_dir():
                raise LoaderError(f"--model {config.model}: not a directory, 'demo' or 'synthetic:NAME' "
                                  f"(presets: {', '.join(synthetic.PRESETS)})")
            model_id = model_dir.resolve().name
        spec, model, banks = load_checkpoint(model_dir, device, dtype, progress)
    if config.moe_expert_dtype is ExpertDType.FP8 and not banks.plain_swiglu:
        raise LoaderError(f"--moe-expert-dtype fp8: {spec.model_type}'s experts (biases, clamped SwiGLU) have no FP8 "
                          "path yet; serve them with --moe-expert-dtype checkpoint")
    stored = banks.layers[0].format if banks.layers else ExpertFormat.UNQUANTIZED
    if config.moe_expert_dtype is ExpertDType.FP8 and stored is not ExpertFormat.UNQUANTIZED:
        raise LoaderError(f"--moe-expert-dtype fp8: the experts are {stored.value} already (a quantized format); serve "
                          "them with --moe-expert-dtype checkpoint, or dtype to dequantize them")
    if config.moe_expert_dtype is ExpertDType.FP8 and stored is ExpertFormat.UNQUANTIZED:
        quantize_layers(banks.layers, progress, work_device=device if device.type == "cuda" else None)
    if config.moe_expert_dtype is ExpertDType.DTYPE:
        dequantize_layers(banks.layers, dtype, progress)
    loaded = LoadedModel(spec, model, banks, Path(model_dir), model_id, device, dtype)
    resolve_max_seq_len(config, spec)
    if attach_backend:
        loaded.model.set_backend(build_backend(loaded, config))
    if progress is not None:
        progress({"phase": "ready", "done": 1, "total": 1, "fraction": 1.0})
    return loaded


def gguf_model_id(path: Path) -> str:
    """The id of a GGUF model: its file name without ``.gguf`` and a split suffix (``-00001-of-00003``)."""
    import re

    return re.sub(r"-\d{5}-of-\d{5}$", "", path.name[:-len(".gguf")])


def _load_gguf(model: str, device: torch.device, dtype: torch.dtype, progress: Callable[[dict], None] | None):
    """(spec, model, banks, tokenizer directory, model id) of a GGUF file; its tokenizer files are written
    next to the demo checkpoint's cache (the engine and the gateway read them from a directory)."""
    from services.engine.models.demo import default_demo_dir
    from services.engine.models.gguf_loader import load_gguf
    from services.engine.models.gguf_tokenizer import tokenizer_dir

    path = Path(model).expanduser()
    spec, net, banks, f = load_gguf(path, device, dtype, progress)
    return spec, net, banks, tokenizer_dir(f, default_demo_dir().parent), gguf_model_id(path)


def build_backend(loaded: LoadedModel, config: EngineConfig) -> ExpertBackend:
    """The expert backend ``config.moe_backend`` for ``loaded`` (host banks pinned first when a
    non-resident backend will copy from them over PCIe)."""
    if config.moe_backend is not MoEBackend.RESIDENT and loaded.device.type == "cuda":
        pin_banks(loaded.banks)
    ctx = BackendContext(banks=loaded.banks, config=config, device=loaded.device, dtype=loaded.dtype,
                         top_k=loaded.spec.top_k, weight_bytes_on_device=loaded.model.non_expert_nbytes(),
                         kv_reserve_bytes=decide_kv_budget(config, loaded.spec, loaded.dtype).nbytes
                         + prefill_workspace_bytes(config, loaded.spec, loaded.dtype),
                         next_layer_predictors=next_layer_predictors(loaded.model)
                         if config.moe_prefetch else None)
    return make_backend(ctx)



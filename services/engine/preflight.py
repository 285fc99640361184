"""Before the engine loads anything: does ``--model`` exist, is it a checkpoint we can load, does it fit?

`tandem serve` and `tandem engine` run ``check_model`` first and exit with one line naming the problem
(status 2), so a wrong path or a model too big for the machine is refused in seconds, not after minutes
of loading. It reads config.json, checks the tokenizer is there and opens every safetensors header (no
weights), then compares what loading will allocate with this machine's memory:

- host RAM: the routed experts always live there (host banks), everything else too on ``--device cpu``;
  compared with MemAvailable (page cache counts as available: the loader's reads are mmapped).
- GPU (``--device cuda``): ``resident`` needs every weight and the KV cache in the VRAM budget (free
  memory, capped by --gpu-memory-limit); the cached backends need the non-expert weights, the KV cache and
  the smallest expert cache there, decided by the same sizing rule the backend applies after loading.

Experts count in the format they are held in (FP8 blocks for an FP8 checkpoint or --moe-expert-dtype
fp8: half of bf16's bytes), except in host RAM under --moe-expert-dtype fp8, where the load's peak is
the checkpoint's own format (all layers are read, then quantized one by one). An unsupported
quantization_config is refused here too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from services.engine.config import EngineConfig, ExpertDType, MoEBackend
from services.engine.models import synthetic
from services.engine.models.causal_lm import MoECausalLM
from services.engine.models.errors import LoaderError
from services.engine.models.gguf_reader import is_gguf
from services.engine.models.loader import check_tokenizer, check_weight_files, read_spec
from services.engine.models.quant_config import checkpoint_format
from services.engine.models.registry import DEMO, TORCH_DTYPES, torch_device
from services.engine.models.spec import ModelSpec
from services.engine.moe.banks import ExpertFormat, expert_nbytes
from services.engine.moe.sizing import GiB, CacheGeometry, decide_cache_size, fmt_bytes
from services.engine.runtime.kv_budget import decide_kv_budget, prefill_workspace_bytes


def check_model(config: EngineConfig) -> ModelSpec:
    """Raise ValueError (LoaderError for the checkpoint itself) naming why ``config.model`` cannot be
    served here; the model's spec otherwise."""
    device = torch_device(config)
    stored = None
    if is_gguf(config.model):
        spec, stored = _check_gguf(config.model)
    elif synthetic.is_synthetic(config.model):
        from tokenizers import Tokenizer

        synthetic.parse_name(config.model)  # a bad name is named before the tokenizer is written
        vocab = Tokenizer.from_file(str(synthetic.tokenizer_dir(config.model) / "tokenizer.json")).get_vocab_size()
        spec = synthetic.synthetic_spec(config.model, vocab)
        stored = _widest(synthetic.expert_formats(config.model, spec), spec)
    else:
        if config.model == DEMO:
            from services.engine.models.demo import ensure_demo_checkpoint

            model_dir = ensure_demo_checkpoint(config.seed)  # what loading does first anyway
        else:
            model_dir = Path(config.model).expanduser()
        if not model_dir.exists():
            raise LoaderError(f"--model {config.model}: no such directory (give a checkpoint directory, 'demo' "
                              f"or 'synthetic:NAME' with NAME one of {', '.join(synthetic.PRESETS)})")
        if not model_dir.is_dir():
            raise LoaderError(f"--model {config.model}: not a directory (a Hugging Face checkpoint is a directory "
                              "with config.json, tokenizer.json and safetensors weights)")
        spec = read_spec(model_dir)
        check_tokenizer(model_dir)
        check_weight_files(model_dir)
    check_fits(spec, config, device, stored=stored)
    return spec


def _check_gguf(model: str) -> tuple[ModelSpec, ExpertFormat]:
    """A GGUF file's spec and its experts' widest format (what every layer's banks take), after reading
    its metadata, every tensor's header, the expert types and the tokenizer (no weights)."""
    from services.engine.models.gguf_loader import layer_format, read_spec as read_gguf_spec
    from services.engine.models.gguf_reader import GGUFFile
    from services.engine.models.gguf_tokenizer import tokenizer_json

    f = GGUFFile(model)
    spec = read_gguf_spec(f)
    tokenizer_json(f)
    return spec, _widest([layer_format(f, layer) for layer in spec.moe_layer_ids], spec)


def _widest(formats: list[ExpertFormat], spec: ModelSpec) -> ExpertFormat:
    """The format of the most bytes per expert among ``formats`` (the banks of every layer take its rows)."""
    D, I = spec.hidden_size, spec.moe_intermediate_size
    return max(formats or [ExpertFormat.UNQUANTIZED], key=lambda fmt: expert_nbytes(fmt, D, I, torch.float32))


def check_fits(spec: ModelSpec, config: EngineConfig, device: torch.device,
               host_available: int | None = None, device_free: int | None = None,
               stored: ExpertFormat | None = None) -> None:
    """ValueError when loading ``spec`` as ``config`` asks cannot fit this machine's memory.
    ``host_available`` / ``device_free`` default to MemAvailable / CUDA's free memory; ``stored``: the
    experts' format in the file (default: what config.json's quantization_config says)."""
    dtype = TORCH_DTYPES[config.dtype]
    if stored is None:
        stored = checkpoint_format(spec.extra, f"--model {config.model}: config.json")
    held = {ExpertDType.FP8: ExpertFormat.FP8_BLOCK, ExpertDType.DTYPE: ExpertFormat.UNQUANTIZED}.get(
        config.moe_expert_dtype, stored)
    geom = CacheGeometry(spec.num_moe_layers, spec.num_experts, spec.top_k,
                         expert_nbytes(held, spec.hidden_size, spec.moe_intermediate_size, dtype))
    experts = geom.total_experts * geom.expert_nbytes
    loading = geom.total_experts * expert_nbytes(stored, spec.hidden_size, spec.moe_intermediate_size, dtype)
    weights = _non_expert_nbytes(spec, dtype)
    kv = decide_kv_budget(config, spec, dtype).nbytes  # also resolves --max-seq-len from the model
    workspace = prefill_workspace_bytes(config, spec, dtype)
    # synthetic + resident on CUDA builds its banks on the GPU directly (registry.load_model)
    banks_on_device = synthetic.is_synthetic(config.model) and config.moe_backend is MoEBackend.RESIDENT
    host_parts = {"experts": 0 if device.type == "cuda" and banks_on_device else max(experts, loading)}
    if device.type == "cpu":
        host_parts.update({"other weights": weights, "KV cache": kv})
    host_available = _mem_available() if host_available is None else host_available
    host_need = sum(host_parts.values())
    if host_available is not None and host_need > host_available:
        raise ValueError(f"--model {config.model} in {config.dtype.value} needs {fmt_bytes(host_need)} of host memory "
                         f"({_describe(host_parts)}) and {fmt_bytes(host_available)} is available; free memory, "
                         "give a smaller model, or cut --kv-cache-memory / --max-seq-len")
    free = None
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0] if device_free is None else device_free
        if config.moe_backend is MoEBackend.RESIDENT:
            budget = free if config.gpu_memory_limit is None else min(free, int(config.gpu_memory_limit * GiB))
            parts = {"experts": max(experts, loading) if banks_on_device else experts, "other weights": weights,
                     "KV cache": kv, "prefill workspace": workspace}
            if sum(parts.values()) > budget:
                raise ValueError(f"--moe-backend resident: --model {config.model} needs {fmt_bytes(sum(parts.values()))} "
                                 f"of GPU memory ({_describe(parts)}), the budget is {fmt_bytes(budget)}; use "
                                 "--moe-backend offload or hybrid (experts in host memory, a GPU cache of them)")
        elif weights + kv > free:
            raise ValueError(f"--model {config.model}: the non-expert weights and KV cache need "
                             f"{fmt_bytes(weights + kv)} of GPU memory ({_describe({'weights': weights, 'KV cache': kv})}) "
                             f"and {fmt_bytes(free)} is free; cut --kv-cache-memory / --max-seq-len")
    if config.moe_backend is not MoEBackend.RESIDENT:
        # The cached backends size their expert cache with this rule once the weights are on the device
        # (CUDA's free memory is then that much lower); below one token's experts it raises.
        decide_cache_size(config, geom, device, weights, kv, free_bytes=None if free is None else free - weights,
                          log_decision=False)


def check_model_or_exit(prog: str, config: EngineConfig) -> None:
    """``check_model`` for a command's main: the reason on one line of stderr, exit status 2."""
    try:
        check_model(config)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _non_expert_nbytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    with torch.device("meta"):  # shapes only, nothing allocated
        return MoECausalLM(spec).to(dtype).non_expert_nbytes()


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None  # not Linux: no check


def _describe(parts: dict[str, int]) -> str:
    return " + ".join(f"{name} {fmt_bytes(n)}" for name, n in parts.items() if n)

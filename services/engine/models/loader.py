"""Read a Hugging Face checkpoint directory into a MoECausalLM (non-expert weights, on the device)
and ExpertBanks (routed experts, host memory).

Layout: ``config.json``, ``tokenizer.json``, and either ``model.safetensors`` or shards listed in
``model.safetensors.index.json``. Expert tensor names are the Hub's, one tensor per expert
(``model.layers.3.mlp.experts.7.gate_proj.weight``; Mixtral
``model.layers.3.block_sparse_moe.experts.7.w1.weight``) — transformers 5.24 fuses experts in memory
but its ``save_pretrained`` still writes these per-expert names (checked). The fused in-memory names
(``...mlp.experts.gate_up_proj`` [E, 2I, D], ``...mlp.experts.down_proj`` [E, D, I]) are accepted too,
per layer, when the per-expert names are absent.

Experts are copied straight into their bank slice, one checkpoint tensor at a time (safetensors mmaps
the file), so no full-size temporary exists. Every error is a LoaderError naming the file and tensor.

Fine-grained FP8 checkpoints (models/quant_config.py) load their experts as they are into fp8_block
banks (weights + block scales); their other FP8 weights (attention projections) are dequantized into
the model dtype here, at load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from services.common.logging import get_logger
from services.engine.models.causal_lm import MoECausalLM
from services.engine.models.errors import LoaderError
from services.engine.models import gpt_oss_experts
from services.engine.models.quant_config import check_fp8_pair, checkpoint_format, scale_name
from services.engine.models.spec import ExpertLayout, ModelSpec
from services.engine.moe.banks import ExpertBanks, ExpertFormat
from services.engine.moe.fp8 import FP8_DTYPE, dequantize, grid

__all__ = ["LoaderError", "load_checkpoint", "read_spec", "check_tokenizer", "check_weight_files", "build_empty_model"]

log = get_logger("loader")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
Progress = Callable[[dict], None]


class LoadProgress:
    """One step per tensor copied: a progress bar on the terminal and ``progress`` dicts for /health. Called as
    ``step()``; ``close()`` ends the bar."""

    def __init__(self, total: int, name: str, progress: Progress | None):
        self.total, self.done, self.progress = total, 0, progress
        self.bar = tqdm(total=total, desc=f"loading {name}", unit="tensor", leave=False)

    def __call__(self) -> None:
        self.done += 1
        self.bar.update(1)
        if self.progress is not None:
            self.progress({"phase": "loading", "done": self.done, "total": self.total,
                           "fraction": self.done / self.total})

    def close(self) -> None:
        self.bar.close()


def read_spec(model_dir: Path) -> ModelSpec:
    """``model_dir/config.json`` -> ModelSpec (LoaderError if missing, unreadable or unsupported)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise LoaderError(f"{path}: missing config.json (not a Hugging Face checkpoint directory?)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise LoaderError(f"{path}: cannot read config.json ({e})") from e
    return ModelSpec.from_hf_config(cfg, source=str(path))


def check_tokenizer(model_dir: Path) -> None:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise LoaderError(f"{path}: missing tokenizer.json (the engine needs the checkpoint's tokenizer)")


def check_weight_files(model_dir: Path) -> None:
    """Read the shard index and every safetensors header, no weights: a missing, truncated or corrupt
    file is named in milliseconds instead of when the loader reaches it."""
    ckpt = _Checkpoint(model_dir)
    for path in sorted(set(ckpt.file_of.values())):
        ckpt._open(path)


def build_empty_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> MoECausalLM:
    """The module with uninitialised parameters of ``dtype`` on ``device`` (built on 'meta' first:
    no CPU-side random init of weights that are overwritten anyway)."""
    with torch.device("meta"):
        model = MoECausalLM(spec)
    model = model.to(dtype=dtype).to_empty(device=device)
    if spec.tie_word_embeddings:  # to_empty un-ties; tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _expert_names(spec: ModelSpec, layer: int, e: int) -> tuple[str, str, str]:
    gate, up, down = spec.traits.expert_proj
    p = f"model.layers.{layer}.{spec.traits.moe_prefix}.experts.{e}."
    return p + f"{gate}.weight", p + f"{up}.weight", p + f"{down}.weight"


def _fused_names(spec: ModelSpec, layer: int) -> tuple[str, str]:
    p = f"model.layers.{layer}.{spec.traits.moe_prefix}.experts."
    return p + "gate_up_proj", p + "down_proj"


class _Checkpoint:
    """Name -> file map of a single-file or sharded checkpoint; opens each file once, lazily."""

    def __init__(self, model_dir: Path) -> None:
        from safetensors import safe_open

        self._safe_open = safe_open
        self.dir = Path(model_dir)
        self._handles: dict[Path, object] = {}
        index, single = self.dir / INDEX_FILE, self.dir / SINGLE_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise LoaderError(f"{index}: cannot read the shard index ({e})") from e
            self.file_of = {name: self.dir / f for name, f in weight_map.items()}
            self.where = INDEX_FILE
        elif single.is_file():
            self.file_of = {name: single for name in self._open(single).keys()}
            self.where = SINGLE_FILE
        else:
            raise LoaderError(f"{self.dir}: no {SINGLE_FILE} and no {INDEX_FILE}")

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise LoaderError(f"{path}: shard file listed in {INDEX_FILE} is missing")
            try:
                self._handles[path] = self._safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own SafetensorError (header, truncation)
                raise LoaderError(f"{path}: corrupt or truncated safetensors file ({e})") from e
        return self._handles[path]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Tensor ``name`` (checked to be ``shape``) as a CPU tensor (mmapped where possible)."""
        if name not in self.file_of:
            raise LoaderError(f"{self.dir / self.where}: missing tensor {name!r}")
        path = self.file_of[name]
        handle = self._open(path)
        try:
            got = tuple(handle.get_slice(name).get_shape())
            if got != tuple(shape):
                raise LoaderError(f"{path}: tensor {name!r} has shape {list(got)}, expected {list(shape)}")
            return handle.get_tensor(name)
        except LoaderError:
            raise
        except Exception as e:
            raise LoaderError(f"{path}: cannot read tensor {name!r}: corrupt or truncated file ({e})") from e

    def fp8(self, name: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 weight ``name`` [N, K] and its block scales [ceil(N/128), ceil(K/128)] (as stored)."""
        q = self.get(name, shape)
        scale = self.get(scale_name(name), (grid(shape[0]), grid(shape[1])))
        check_fp8_pair(str(self.file_of[name]), name, q, scale)
        return q, scale

    def weight(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Tensor ``name`` as a plain weight: an FP8 one (a weight_scale_inv beside it) dequantized to ``dtype``."""
        if scale_name(name) in self and len(shape) == 2:
            return dequantize(*self.fp8(name, shape), dtype)
        t = self.get(name, shape)
        if t.dtype == FP8_DTYPE:
            raise LoaderError(f"{self.file_of[name]}: tensor {name!r} is float8_e4m3fn without a "
                              f"{scale_name(name)!r} beside it (per-tensor FP8 is not supported)")
        return t


def load_checkpoint(model_dir: str | Path, device: torch.device, dtype: torch.dtype,
                    progress: Progress | None = None) -> tuple[ModelSpec, MoECausalLM, ExpertBanks]:
    """Load ``model_dir``: (spec, model with non-expert weights on ``device``, host ExpertBanks).

    ``progress`` (optional) gets ``{"phase": "loading", "done": n, "total": N, "fraction": f}`` after
    each tensor; a tqdm bar shows the same on stderr.
    """
    model_dir = Path(model_dir)
    spec = read_spec(model_dir)
    check_tokenizer(model_dir)
    ckpt = _Checkpoint(model_dir)
    model = build_empty_model(spec, torch.device(device), dtype)
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    fmt = checkpoint_format(spec.extra, str(model_dir / "config.json"))
    banks = ExpertBanks.allocate(fmt, spec.num_moe_layers, E, D, I, dtype,
                                 bias=spec.expert_bias, activation=spec.expert_activation)
    gpt_oss = spec.traits.expert_layout is ExpertLayout.GPT_OSS

    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    if spec.tie_word_embeddings and "lm_head.weight" in ckpt:
        params.pop("model.embed_tokens.weight", None)  # prefer the explicit head; embed copied after
        params["lm_head.weight"] = model.lm_head.weight
    fused = [layer for layer in spec.moe_layer_ids if not gpt_oss
             and _expert_names(spec, layer, 0)[0] not in ckpt and _fused_names(spec, layer)[0] in ckpt]
    if fused and fmt is not ExpertFormat.UNQUANTIZED:
        raise LoaderError(f"{ckpt.dir / ckpt.where}: fused expert tensors ({_fused_names(spec, fused[0])[0]!r}) in "
                          "an FP8 checkpoint are not supported; the loader reads per-expert FP8 tensors")
    total = len(params) + (gpt_oss_experts.num_steps(spec) if gpt_oss else
                           sum(2 if layer in fused else 3 * E for layer in spec.moe_layer_ids))
    step = LoadProgress(total, model_dir.name, progress)

    try:
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(ckpt.weight(name, tuple(param.shape), param.dtype))
                step()
            if gpt_oss:  # fused Hub tensors, interleaved gate/up, biases; MXFP4 dequantized here
                for ordinal, layer in enumerate(spec.moe_layer_ids):
                    gpt_oss_experts.load_layer(ckpt, spec, layer, banks.layers[ordinal], step)
            elif fmt is ExpertFormat.FP8_BLOCK:
                _load_fp8_experts(spec, ckpt, banks, step)
            else:
                _load_experts(spec, ckpt, banks, fused, step)
    finally:
        step.close()
    log.info("loaded %s: %s, %d layers (%d MoE), E=%d, A=%d, D=%d, I=%d, experts %s", model_dir, spec.model_type,
             spec.num_layers, spec.num_moe_layers, E, spec.top_k, D, I, fmt.value)
    return spec, model, banks


def _load_experts(spec: ModelSpec, ckpt: _Checkpoint, banks: ExpertBanks, fused: list[int],
                  step: Callable[[], None]) -> None:
    """Unquantized experts into their banks: per-expert tensors, or a layer's fused ones as they are."""
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    for ordinal, layer in enumerate(spec.moe_layer_ids):
        gate_up = banks.layers[ordinal].tensors["gate_up"]  # [E, 2I, D]
        down = banks.layers[ordinal].tensors["down"]  # [E, D, I]
        if layer in fused:
            gu_name, down_name = _fused_names(spec, layer)
            gate_up.copy_(ckpt.get(gu_name, (E, 2 * I, D)))
            step()
            down.copy_(ckpt.get(down_name, (E, D, I)))
            step()
            continue
        for e in range(E):
            g_name, u_name, d_name = _expert_names(spec, layer, e)
            gate_up[e, :I].copy_(ckpt.weight(g_name, (I, D), gate_up.dtype))
            step()
            gate_up[e, I:].copy_(ckpt.weight(u_name, (I, D), gate_up.dtype))
            step()
            down[e].copy_(ckpt.weight(d_name, (D, I), down.dtype))
            step()


def _load_fp8_experts(spec: ModelSpec, ckpt: _Checkpoint, banks: ExpertBanks, step: Callable[[], None]) -> None:
    """Per-expert FP8 tensors into fp8_block banks: gate rows then up rows of gate_up, each with its own
    scale grid (gate's block rows, then up's: services/engine/moe/fp8.py), down and its scales."""
    D, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    nb = grid(I)
    for ordinal, layer in enumerate(spec.moe_layer_ids):
        t = banks.layers[ordinal].tensors  # gate_up [E, 2I, D], down [E, D, I] fp8; their scales fp32
        for e in range(E):
            g_name, u_name, d_name = _expert_names(spec, layer, e)
            for name, rows, scale_rows in ((g_name, slice(0, I), slice(0, nb)), (u_name, slice(I, 2 * I), slice(nb, 2 * nb))):
                q, scale = ckpt.fp8(name, (I, D))
                t["gate_up"][e, rows].copy_(q)
                t["gate_up_scale"][e, scale_rows].copy_(scale)
                step()
            q, scale = ckpt.fp8(d_name, (D, I))
            t["down"][e].copy_(q)
            t["down_scale"][e].copy_(scale)
            step()

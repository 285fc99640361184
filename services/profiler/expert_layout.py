"""Where each expert tensor of a safetensors checkpoint lives on disk, and where it goes in the banks.

Dimension legend: L MoE layers · E experts · D hidden · I expert intermediate.

The loader benchmark reads the same bytes three ways; all of them are driven by this one plan:
a list of byte-range copy jobs ``file[src_offset : src_offset+nbytes] -> bank[dst_offset : ...]``.
Bank layout (services/engine/moe/banks.py): gate_up [E, 2I, D] = gate rows then up rows; down [E, D, I].
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from services.engine.models.spec import ModelSpec
from services.engine.moe.banks import ExpertBanks, ExpertFormat

# safetensors dtype names -> torch
SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass(frozen=True)
class CopyJob:
    """One contiguous byte range: ``file[src_offset, +nbytes) -> banks.layers[layer].tensors[bank]``
    (flat bytes) at ``dst_offset``. ``name`` is the tensor name (serial reads go by name)."""

    file: Path
    src_offset: int
    nbytes: int
    layer: int  # MoE-layer ordinal
    bank: str
    dst_offset: int
    name: str = ""


@dataclass
class ExpertLayout:
    spec: ModelSpec
    dtype: torch.dtype
    files: list[Path]  # every file holding an expert tensor
    jobs: list[CopyJob]

    @property
    def total_bytes(self) -> int:
        return sum(j.nbytes for j in self.jobs)

    def allocate(self) -> ExpertBanks:
        s = self.spec
        return ExpertBanks.allocate(ExpertFormat.UNQUANTIZED, s.num_moe_layers, s.num_experts, s.hidden_size,
                                    s.moe_intermediate_size, self.dtype)


def read_safetensors_header(path: Path) -> tuple[dict, int]:
    """(tensor table, byte offset where data starts) of one .safetensors file."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", head)
        table = json.loads(f.read(n))
    table.pop("__metadata__", None)
    return table, 8 + n


def _shards(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir}: no *.safetensors files (Hugging Face layout expected)")
    return files


def expert_layout(model_dir: str | Path) -> ExpertLayout:
    """Plan the copy jobs of every routed expert in ``model_dir`` (HF layout, per-expert tensor names
    as published). Raises ValueError naming the tensor when one is missing or has the wrong shape."""
    model_dir = Path(model_dir)
    spec = ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()),
                                    source=str(model_dir / "config.json"))
    where: dict[str, tuple[Path, dict, int]] = {}
    for shard in _shards(model_dir):
        table, data_start = read_safetensors_header(shard)
        for name, info in table.items():
            where[name] = (shard, info, data_start)
    E, D, I = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    gate, up, down = spec.traits.expert_proj
    prefix = spec.traits.moe_prefix
    jobs, dtype, files = [], None, []
    for ordinal, layer_id in enumerate(spec.moe_layer_ids):
        for e in range(E):
            base = f"model.layers.{layer_id}.{prefix}.experts.{e}"
            # (projection, bank, shape, element offset of this expert's part in the bank)
            parts = ((gate, "gate_up", [I, D], e * 2 * I * D), (up, "gate_up", [I, D], e * 2 * I * D + I * D),
                     (down, "down", [D, I], e * D * I))
            for proj, bank, shape, dst_elem in parts:
                name = f"{base}.{proj}.weight"
                if name not in where:
                    raise ValueError(f"{model_dir}: expert tensor {name} not found in any safetensors file")
                shard, info, data_start = where[name]
                t_dtype = SAFETENSORS_DTYPES.get(info["dtype"])
                if t_dtype is None or (dtype is not None and t_dtype != dtype):
                    raise ValueError(f"{shard}: tensor {name} has dtype {info['dtype']}, expected "
                                     f"{dtype or 'one of ' + ', '.join(SAFETENSORS_DTYPES)}")
                if list(info["shape"]) != shape:
                    raise ValueError(f"{shard}: tensor {name} has shape {info['shape']}, expected {shape}")
                dtype = t_dtype
                begin, end = info["data_offsets"]
                isz = torch.empty((), dtype=dtype).element_size()
                jobs.append(CopyJob(shard, data_start + begin, end - begin, ordinal, bank, dst_elem * isz, name))
                if shard not in files:
                    files.append(shard)
    return ExpertLayout(spec, dtype or torch.float32, files, jobs)

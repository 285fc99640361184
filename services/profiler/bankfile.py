"""The repacked bank file: all MoE layers' expert banks, contiguous per layer and bank, one file.

Format (docs/bank-file-format.md is the full description):

    [0, 8)        magic b"TNDMBNK1"
    [8, 16)       header length H, little-endian u64
    [16, 16+H)    header, UTF-8 JSON (geometry, dtype, bank table, per-layer offsets, source stamp)
    ...           zero padding to the first 4096-aligned offset
    data          for each MoE layer, for each bank of the format (schema order): the bank [E, ...]
                  as raw little-endian bytes, each region starting 4096-aligned

One region per (layer, bank) is one sequential read straight into the bank tensor — no per-expert
gather, no name lookups — which is what makes the `repacked` loader mode fast.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch

from services.common.atomic_file import atomic_write
from services.engine.moe.banks import BANK_SCHEMAS, ExpertBanks, ExpertFormat
from services.profiler.expert_layout import CopyJob, ExpertLayout

MAGIC = b"TNDMBNK1"
FORMAT_VERSION = 1
ALIGN = 4096
FILENAME = "banks.tbk"


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def source_stamp(files: list[Path]) -> list[dict]:
    """Name, size and mtime of each source shard: a changed checkpoint invalidates the bank file."""
    return [{"name": f.name, "size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns} for f in files]


def write_bank_file(path: str | Path, banks: ExpertBanks, layout: ExpertLayout) -> Path:
    """Write ``banks`` (as loaded from ``layout``'s checkpoint) to ``path`` atomically; returns path."""
    path = Path(path)
    spec, fmt = layout.spec, ExpertFormat.UNQUANTIZED
    layers, sizes = [], []
    for ordinal, layer in enumerate(banks.layers):
        entry = {"ordinal": ordinal, "layer_id": spec.moe_layer_ids[ordinal], "banks": {}}
        for b in BANK_SCHEMAS[fmt]:
            t = layer.tensors[b.name]
            entry["banks"][b.name] = {"nbytes": t.numel() * t.element_size(), "offset": 0}
            sizes.append((entry, b.name))
        layers.append(entry)
    header = {
        "format_version": FORMAT_VERSION, "expert_format": fmt.value, "dtype": str(layout.dtype).removeprefix("torch."),
        "model_type": spec.model_type, "num_experts": spec.num_experts, "hidden_size": spec.hidden_size,
        "moe_intermediate_size": spec.moe_intermediate_size, "moe_layer_ids": list(spec.moe_layer_ids),
        "banks": [{"name": b.name, "shape": list(b.shape(spec.hidden_size, spec.moe_intermediate_size))}
                  for b in BANK_SCHEMAS[fmt]],
        "layers": layers, "source": source_stamp(layout.files),
    }
    # Offsets depend on the header length, which depends on the offsets' digits: give the header a
    # fixed generous slot (128 bytes per region and per source file), then lay out the data after it.
    header_slot = _align(16 + 4096 + 128 * (len(sizes) + len(layout.files)))
    pos = header_slot
    for entry, name in sizes:
        entry["banks"][name]["offset"] = pos
        pos = _align(pos + entry["banks"][name]["nbytes"])
    blob = json.dumps(header).encode()
    if 16 + len(blob) > header_slot:
        raise ValueError(f"{path}: header of {len(blob)} bytes does not fit its {header_slot}-byte slot")
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
        for ordinal, layer in enumerate(banks.layers):
            for b in BANK_SCHEMAS[fmt]:
                region = layers[ordinal]["banks"][b.name]
                f.seek(region["offset"])
                f.write(layer.tensors[b.name].contiguous().view(torch.uint8).numpy())  # no extra copy
        f.truncate(pos)
    return path


def read_header(path: str | Path) -> dict:
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) != 16 or head[:8] != MAGIC:
            raise ValueError(f"{path}: not a Tandem bank file (bad magic)")
        (n,) = struct.unpack("<Q", head[8:])
        header = json.loads(f.read(n))
    if header.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: bank file format_version {header.get('format_version')}, expected {FORMAT_VERSION}")
    return header


def is_current(path: str | Path, layout: ExpertLayout) -> bool:
    """Whether ``path`` exists and was converted from exactly ``layout``'s checkpoint files."""
    try:
        return read_header(path)["source"] == source_stamp(layout.files)
    except (OSError, ValueError, KeyError):
        return False


def bank_file_jobs(path: str | Path) -> tuple[dict, list[CopyJob]]:
    """(header, one copy job per (layer, bank) region) — the `repacked` loader reads these directly."""
    path = Path(path)
    header = read_header(path)
    jobs = [CopyJob(path, region["offset"], region["nbytes"], entry["ordinal"], name, 0)
            for entry in header["layers"] for name, region in entry["banks"].items()]
    return header, jobs

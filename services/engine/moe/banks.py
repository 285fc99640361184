"""Host expert banks: per MoE layer, per format, one stacked tensor ``[E, ...]`` per bank.

Dimension legend (used across services/engine and kernels/):
    T tokens in the step · E experts per layer · A experts per token (top-k) · D hidden size
    I expert intermediate size · L MoE layers · S cache slots

The schema table below is the one place that says which banks a format has; the loader fills them,
the slot cache mirrors them slot-for-slot on the GPU, ``copy_missing`` copies every bank of a job,
and the CPU executor reads them in place.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.common.logging import get_logger

log = get_logger("moe.banks")


class ExpertFormat(str, enum.Enum):
    # Weights stored in the model dtype (bf16 or fp32). Quantized formats (mxfp4, int8...) add
    # entries here with their scale banks; nothing else in the tree hard-codes bank names.
    UNQUANTIZED = "unquantized"


@dataclass(frozen=True)
class BankSpec:
    name: str
    shape: Callable[[int, int], tuple[int, ...]]  # (D, I) -> per-expert shape
    dtype: torch.dtype | None = None  # None: the model dtype; quantized formats fix theirs


BANK_SCHEMAS: dict[ExpertFormat, tuple[BankSpec, ...]] = {
    ExpertFormat.UNQUANTIZED: (
        BankSpec("gate_up", lambda D, I: (2 * I, D)),  # rows [0, I) = gate_proj, [I, 2I) = up_proj
        BankSpec("down", lambda D, I: (D, I)),  # down_proj
    ),
}


@dataclass
class LayerBanks:
    """The banks of one MoE layer: ``tensors[name]`` is ``[E, *spec.shape(D, I)]``."""

    format: ExpertFormat
    tensors: dict[str, torch.Tensor]

    @property
    def num_experts(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def expert_nbytes(self) -> int:
        """Bytes of one expert across all banks (what one fetch moves)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())


@dataclass
class ExpertBanks:
    """All MoE layers' banks, indexed by MoE-layer ordinal (dense layers have none)."""

    layers: list[LayerBanks] = field(default_factory=list)

    @staticmethod
    def allocate(fmt: ExpertFormat, num_layers: int, E: int, D: int, I: int, dtype: torch.dtype) -> "ExpertBanks":
        """Empty host banks to be filled by a loader (filled first, pinned later by pin_banks)."""
        layers = []
        for _ in range(num_layers):
            tensors = {s.name: torch.empty((E, *s.shape(D, I)), dtype=s.dtype or dtype) for s in BANK_SCHEMAS[fmt]}
            layers.append(LayerBanks(fmt, tensors))
        return ExpertBanks(layers)

    def expert_nbytes(self) -> int:
        return self.layers[0].expert_nbytes() if self.layers else 0

    def total_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors.values())


_FAST_PINNING: bool | None = None


def enable_fast_pinning() -> bool:
    """Have torch's pinned host allocator malloc, touch the pages on several threads and cudaHostRegister
    them, instead of one cudaHostAlloc (which pins page by page under the driver's lock: ~1.2 GB/s on the
    H200 host, 25 s to pin the 29 GB of the 24-layer benchmark model). Registered memory is mapped at the
    same address on UVA systems, which the UVA kernels (copy_missing, the graph handoff) rely on. Once per
    process, before the first pinned allocation; False (and the default allocator) if torch refuses."""
    global _FAST_PINNING
    if _FAST_PINNING is None:
        threads = max(1, min(16, os.cpu_count() or 1))
        setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
        try:
            set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or \
                torch.cuda.memory._set_allocator_settings
            set_settings(setting)
            _FAST_PINNING = True
        except Exception as exc:  # noqa: BLE001 - an older torch: pinning works, only slower; say so
            log.warning("pinned host memory: torch refused %r (%s); using cudaHostAlloc", setting, exc)
            _FAST_PINNING = False
    return _FAST_PINNING


def host_page_report(tensors: list[torch.Tensor]) -> dict:
    """The memory mappings holding ``tensors`` (/proc/self/smaps): their bytes, how many of those are
    transparent huge pages, and the system's THP mode. Why: the CPU executor streams the banks, so 4 KiB
    pages cost it a page walk every 64 cache lines; whether a server got huge pages may differ from
    server to server. {} where /proc is not readable."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors if t.numel())
    try:
        lines = open("/proc/self/smaps").read().splitlines()
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return {}
    total = huge = regions = 0
    holds = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):  # a mapping's first line: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            holds = any(a < hi and b > lo for a, b in spans)
            if holds:
                total, regions = total + hi - lo, regions + 1
        elif holds and head == "AnonHugePages:":
            huge += int(line.split()[1]) * 1024
    return {"bytes": total, "huge_page_bytes": huge, "regions": regions, "thp": mode}


def pin_banks(banks: ExpertBanks) -> None:
    """Replace every host bank by a pinned copy, one bank at a time (the peak is one bank above the
    banks' size)."""
    enable_fast_pinning()
    for layer in banks.layers:
        for name, t in layer.tensors.items():
            if t.device.type == "cpu" and not t.is_pinned():
                layer.tensors[name] = t.pin_memory()

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
from dataclasses import dataclass, field
from typing import Callable

import torch


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
        """Empty host banks to be filled by a loader (filled first, pinned later: pinned allocation up
        front is several times slower)."""
        layers = []
        for _ in range(num_layers):
            tensors = {s.name: torch.empty((E, *s.shape(D, I)), dtype=s.dtype or dtype) for s in BANK_SCHEMAS[fmt]}
            layers.append(LayerBanks(fmt, tensors))
        return ExpertBanks(layers)

    def expert_nbytes(self) -> int:
        return self.layers[0].expert_nbytes() if self.layers else 0

    def total_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors.values())

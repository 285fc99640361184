"""Host expert banks: per MoE layer, per format, one stacked tensor ``[E, ...]`` per bank.

Dimension legend (used across services/engine and kernels/):
    T tokens in the step · E experts per layer · A experts per token (top-k) · D hidden size
    I expert intermediate size · L MoE layers · S cache slots

The schema table below is the one place that says which banks a format has; the loader fills them,
the slot cache mirrors them slot-for-slot on the GPU, ``copy_missing`` copies every bank of a job,
and the CPU executor reads them in place.
"""

from __future__ import annotations

import ctypes
import enum
import math
import mmap
import os
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from services.common.logging import get_logger
from services.engine.moe.gguf_quant import BLOCK, GGUFType, row_bytes
from services.engine.moe.reference import ClampedSwiGLU

log = get_logger("moe.banks")


class ExpertFormat(str, enum.Enum):
    # Weights stored in the model dtype (bf16 or fp32). Quantized formats add entries here with their
    # scale banks; nothing else in the tree hard-codes bank names.
    UNQUANTIZED = "unquantized"
    # float8_e4m3fn weights with an fp32 scale per 128x128 block (services/engine/moe/fp8.py)
    FP8_BLOCK = "fp8_block"
    # OCP MXFP4 as gpt-oss checkpoints ship their experts: e2m1 values packed two per byte with one E8M0
    # exponent byte per 32 consecutive values of a row (services/engine/models/mxfp4.py)
    MXFP4 = "mxfp4"
    # GGUF (llama.cpp) block types kept as the file stores them (docs/gguf.md): uint8 banks, per row of a
    # matrix that row's blocks, each block carrying its own scales (no scale banks). The name gives the
    # types of gate_up and down: a Q4_K_M file's layers are q4_K (down in q4_K too) or q4_K+q6_K.
    Q4_K = "q4_K"
    Q5_K = "q5_K"
    Q6_K = "q6_K"
    Q8_0 = "q8_0"
    MXFP4_GGUF = "mxfp4_gguf"  # MXFP4 in GGUF's 17-byte blocks (E8M0 byte, then 16 bytes of e2m1 pairs)
    Q4_K_Q6_K = "q4_K+q6_K"
    Q5_K_Q6_K = "q5_K+q6_K"


# per GGUF format, the types of (gate_up, down) (services/engine/moe/gguf_quant.py: block layouts, row bytes)
_Q4K, _Q5K, _Q6K, _Q80, _MX = GGUFType.Q4_K, GGUFType.Q5_K, GGUFType.Q6_K, GGUFType.Q8_0, GGUFType.MXFP4
GGUF_TYPES: dict[ExpertFormat, tuple[GGUFType, GGUFType]] = {
    ExpertFormat.Q4_K: (_Q4K, _Q4K), ExpertFormat.Q5_K: (_Q5K, _Q5K), ExpertFormat.Q6_K: (_Q6K, _Q6K),
    ExpertFormat.Q8_0: (_Q80, _Q80), ExpertFormat.MXFP4_GGUF: (_MX, _MX),
    ExpertFormat.Q4_K_Q6_K: (_Q4K, _Q6K), ExpertFormat.Q5_K_Q6_K: (_Q5K, _Q6K),
}


def gguf_format(gate_up: GGUFType | str, down: GGUFType | str) -> ExpertFormat:
    """The format of experts whose gate_up is in GGUF type ``gate_up`` and down in ``down``; ValueError
    naming the supported pairs otherwise."""
    for fmt, types in GGUF_TYPES.items():
        if types == (GGUFType(gate_up), GGUFType(down)):
            return fmt
    pairs = ", ".join("/".join(t.value for t in types) for types in GGUF_TYPES.values())
    raise ValueError(f"experts with gate/up in {gate_up} and down in {down} are not supported "
                     f"(supported gate_up/down types: {pairs})")


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
    # the scale banks come after the weights: a job's weight bytes stay first, in the same order
    ExpertFormat.FP8_BLOCK: (
        BankSpec("gate_up", lambda D, I: (2 * I, D), torch.float8_e4m3fn),
        BankSpec("down", lambda D, I: (D, I), torch.float8_e4m3fn),
        BankSpec("gate_up_scale", lambda D, I: (2 * _blocks(I), _blocks(D)), torch.float32),  # gate's grid, up's
        BankSpec("down_scale", lambda D, I: (_blocks(D), _blocks(I)), torch.float32),
    ),
    # Per row, byte j holds elements 2j (low nibble) and 2j+1 (high nibble); scale byte b covers elements
    # [32b, 32b+32) of its row. gate_up rows [0, I) gate, [I, 2I) up (the Hub's interleaved rows are
    # de-interleaved at load: whole rows move, lossless). D and I must be multiples of 32.
    ExpertFormat.MXFP4: (
        BankSpec("gate_up", lambda D, I: (2 * I, D // 2), torch.uint8),
        BankSpec("down", lambda D, I: (D, I // 2), torch.uint8),
        BankSpec("gate_up_scale", lambda D, I: (2 * I, D // 32), torch.uint8),  # E8M0: 2**(s - 127)
        BankSpec("down_scale", lambda D, I: (D, I // 32), torch.uint8),
    ),
    # GGUF formats: gate_up [2I, row bytes of D values] (rows [0, I) gate, [I, 2I) up), down [D, row bytes of I]
    **{fmt: (BankSpec("gate_up", lambda D, I, t=gu: (2 * I, row_bytes(t, D)), torch.uint8),
             BankSpec("down", lambda D, I, t=dn: (D, row_bytes(t, I)), torch.uint8))
       for fmt, (gu, dn) in GGUF_TYPES.items()},
}

# the banks that hold a format's scales (beside the weights gate_up / down), by format: what a compute
# path passes as gate_up_scale / down_scale together with the format (never by name alone: fp8_block's
# are fp32 per 128x128 block, mxfp4's E8M0 bytes per 32 values of a row)
SCALE_BANKS: dict[ExpertFormat, tuple[str, ...]] = {
    ExpertFormat.UNQUANTIZED: (),
    ExpertFormat.FP8_BLOCK: ("gate_up_scale", "down_scale"),
    ExpertFormat.MXFP4: ("gate_up_scale", "down_scale"),
    **{fmt: () for fmt in GGUF_TYPES},  # GGUF blocks carry their scales inside
}

# Experts with biases (gpt-oss) have these banks too, whatever the weight format; in the model dtype.
BIAS_BANKS: tuple[BankSpec, ...] = (
    BankSpec("gate_up_bias", lambda D, I: (2 * I,)),  # [0, I) gate, [I, 2I) up, like the gate_up rows
    BankSpec("down_bias", lambda D, I: (D,)),
)


def _blocks(n: int) -> int:
    return -(-n // 128)  # the ceil grid of 128-element blocks (fp8.BLOCK; fp8.py imports this module)


def check_geometry(fmt: ExpertFormat, D: int, I: int) -> None:
    """ValueError when the format cannot hold experts of this width (MXFP4: D and I multiples of 32)."""
    if fmt is ExpertFormat.MXFP4 and (D % 32 or I % 32):
        raise ValueError(f"mxfp4 expert banks need the hidden size ({D}) and the expert intermediate size ({I}) "
                         "to be multiples of 32 (one E8M0 scale per 32 values)")
    for qtype, cols, what in zip(GGUF_TYPES.get(fmt, ()), (D, I), ("hidden size", "expert intermediate size")):
        if cols % BLOCK[qtype][0]:
            raise ValueError(f"{qtype.value} expert banks need the {what} ({cols}) to be a multiple of "
                             f"{BLOCK[qtype][0]} (one {qtype.value} block)")


def expert_nbytes(fmt: ExpertFormat, D: int, I: int, dtype: torch.dtype) -> int:
    """Bytes of one expert across the banks of ``fmt`` (``dtype``: the model dtype, for unquantized banks)."""
    return sum(math.prod(s.shape(D, I)) * (s.dtype or dtype).itemsize for s in BANK_SCHEMAS[fmt])


def bank_shapes(formats, D: int, I: int, dtype: torch.dtype, bias: bool = False) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Per bank name, the per-expert shape and dtype of banks that hold layers of any of ``formats``: each
    dimension the largest any format needs (GGUF layers of different types share the widest row)."""
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in dict.fromkeys(formats):
        check_geometry(f, D, I)
        for s in BANK_SCHEMAS[f] + (BIAS_BANKS if bias else ()):
            shape, old = s.shape(D, I), shapes.get(s.name)
            if old is not None and (old[1] != (s.dtype or dtype) or len(old[0]) != len(shape)):
                raise ValueError(f"expert banks: layer formats {sorted({x.value for x in formats})} disagree "
                                 f"on bank {s.name!r}")
            shapes[s.name] = (shape if old is None else tuple(map(max, old[0], shape)), s.dtype or dtype)
    return shapes


@dataclass
class LayerBanks:
    """The banks of one MoE layer: ``tensors[name]`` is ``[E, *spec.shape(D, I)]``."""

    format: ExpertFormat
    tensors: dict[str, torch.Tensor]

    @property
    def num_experts(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    @property
    def bias(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(gate_up_bias [E, 2I], down_bias [E, D]) when the experts have biases, else None."""
        if "gate_up_bias" not in self.tensors:
            return None
        return self.tensors["gate_up_bias"], self.tensors["down_bias"]

    def expert_nbytes(self) -> int:
        """Bytes of one expert across all banks (what one fetch moves)."""
        return sum(t[0].numel() * t.element_size() for t in self.tensors.values())

    def ordered(self) -> list[torch.Tensor]:
        """The banks in BANK_SCHEMAS order (weights first, then any scales): how the CPU executor takes them."""
        return [self.tensors[s.name] for s in BANK_SCHEMAS[self.format]]

@dataclass
class ExpertBanks:
    """All MoE layers' banks, indexed by MoE-layer ordinal (dense layers have none)."""

    layers: list[LayerBanks] = field(default_factory=list)
    activation: ClampedSwiGLU | None = None  # gpt-oss's clamped SwiGLU; None: silu(gate) * up

    @staticmethod
    def allocate(fmt: ExpertFormat | list[ExpertFormat], num_layers: int, E: int, D: int, I: int,
                 dtype: torch.dtype, pin: bool = False, bias: bool = False,
                 activation: ClampedSwiGLU | None = None) -> "ExpertBanks":
        """Empty host banks to be filled by a loader (``host_bank`` memory; pinned now with ``pin``, else
        later by pin_banks, in place). ``bias``: add the BIAS_BANKS. ``fmt``: one format, or one per layer
        (GGUF files mix types across layers: a Q4_K_M file's down is q6_K in some, q4_K in others); every
        layer's banks then take the widest row of any layer, so the slot cache's slots (one shape for all
        layers) hold an expert of any layer; a layer's format says how many bytes of a row it uses."""
        formats = [fmt] * num_layers if isinstance(fmt, ExpertFormat) else list(fmt)
        if len(formats) != num_layers:
            raise ValueError(f"expert banks: {len(formats)} formats for {num_layers} layers")
        shapes = bank_shapes(formats, D, I, dtype, bias)
        layers = [LayerBanks(f, {name: host_bank((E, *shape), dt) for name, (shape, dt) in shapes.items()})
                  for f in formats]
        banks = ExpertBanks(layers, activation)
        if pin:
            pin_banks(banks)
        return banks

    def expert_nbytes(self) -> int:
        return self.layers[0].expert_nbytes() if self.layers else 0

    @property
    def plain_swiglu(self) -> bool:
        """True when the experts are bias-free ``silu(gate) * up`` (all the Triton MoE GEMV computes so far);
        gpt-oss's are not."""
        return self.activation is None and not (self.layers and self.layers[0].bias is not None)

    def total_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.tensors.values())


HUGE_PAGE = 2 << 20  # x86-64 transparent huge page


class _HostRegion(mmap.mmap):
    """Anonymous memory under one host bank. Why not torch's allocator: the CPU executor streams the
    banks, and in 4 KiB pages it pays a page walk every 64 cache lines (two-level in a VM) and its L2
    streamer restarts at every page; advised before the first touch, the kernel backs the region with
    2 MiB pages even where THP is 'madvise' only. And a bank can then be pinned in place
    (cudaHostRegister) instead of copied into a pinned twice-the-peak allocation. ``registered`` is the
    address given to CUDA, unregistered when the last tensor over the region is gone."""

    registered: int = 0

    def __del__(self) -> None:
        if self.registered:
            try:
                torch.cuda.cudart().cudaHostUnregister(self.registered)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone already
                pass


_REGIONS: "weakref.WeakValueDictionary[int, _HostRegion]" = weakref.WeakValueDictionary()  # data_ptr -> region


def host_bank(shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = True) -> torch.Tensor:
    """An uninitialised host tensor for a bank: its own mapping, starting on a 2 MiB boundary and advised
    to transparent huge pages unless ``huge_pages`` is False (what `bench_cpu_stream --pages small`
    compares: in 2 MiB pages the executor streamed 110.9 GB/s beside the PCIe copy instead of 90.3)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # private: an anonymous shared mapping is shmem, which THP leaves alone; slack to start on a 2 MiB boundary
    region = _HostRegion(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    anchor = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(anchor) % HUGE_PAGE
    del anchor  # a live export would keep the region from ever closing
    t = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
    _REGIONS[t.data_ptr()] = region
    return t


def _register(t: torch.Tensor) -> None:
    """cudaHostRegister a ``host_bank`` tensor in place (the region then unregisters itself)."""
    region = _REGIONS[t.data_ptr()]
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"pinning a {t.numel() * t.element_size() / 1e9:.2f} GB expert bank failed: "
                           f"cudaHostRegister returned {err}")
    region.registered = t.data_ptr()


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


def pin_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` pinned for the GPU's copies, in order: ``host_bank`` memory in place (registered on up
    to 16 threads: the driver maps each one's pages), any other host tensor as a pinned copy."""
    in_place = [t for t in tensors if t.data_ptr() in _REGIONS and not t.is_pinned()]
    if in_place:
        with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1, len(in_place))) as pool:
            list(pool.map(_register, in_place))
    return [t if t.data_ptr() in _REGIONS or t.is_pinned() else t.pin_memory() for t in tensors]


def pin_banks(banks: ExpertBanks) -> None:
    """Pin every host bank (``pin_host``, all at once so registration spreads over threads), replacing
    the ones that had to be copied."""
    t0 = time.perf_counter()
    slots = [(layer, name) for layer in banks.layers for name, t in layer.tensors.items()
             if t.device.type == "cpu" and not t.is_pinned()]
    for (layer, name), t in zip(slots, pin_host([layer.tensors[name] for layer, name in slots])):
        layer.tensors[name] = t
    if slots:
        log.info("host banks pinned: %.1f GB in %.1f s", sum(layer.tensors[name].nbytes for layer, name in slots) / 1e9,
                 time.perf_counter() - t0)

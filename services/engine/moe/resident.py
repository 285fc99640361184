"""The `resident` backend: every expert of every layer on the compute device, no cache.

Legend: T tokens · A experts per token · R = T*A routes · E experts · D hidden · I intermediate.

Ways to compute the routed experts, same maths as ``moe_reference`` (``moe_compute`` picks):
- grouped (long prefills, and everything on the CPU): routes sorted by expert, one GEMM pair per expert
  present; reads each present expert once. Needs the per-expert counts on the host (one sync), and
  launches ~8 kernels per expert present: ~E x 8 launches per layer.
- decode (small R on CUDA): no host sync and static shapes, so a decode step can be captured in a
  CUDA graph. ``moe_decode`` uses the Triton GEMV kernels (kernels/moe_gemv.py: weights read in
  place) and falls back to ``moe_gathered`` (torch: the R experts' weights gathered into [R, ...],
  then two bmm — 3x the bytes, but still better than ~20 us launches per expert x 8 x 48 layers).
- short prefills on CUDA (R <= PREFILL_GEMV_MAX_ROUTES): the same Triton GEMV, three launches per layer.
  It reads an expert once per route instead of once per step, which at HBM speed costs less than the
  grouped loop's launches up to a few thousand routes (Qwen3-30B-A3B: 9.4 MB per route, ~2.5 us at
  ~4 TB/s, against ~1000 launches of the grouped loop per layer).

FP8 experts (the fp8_block format) come as ``gate_up_scale`` / ``down_scale`` keywords beside the fp8
``gate_up`` / ``down`` (``fp8_scales(banks)`` picks them out of a layer's or the cache's banks): they
are dequantized per expert (grouped), per gathered route (gathered) or in the Triton kernel's
registers (decode).
"""

from __future__ import annotations

import torch

from services.common.logging import get_logger
from services.engine.config import MoEBackend
from services.engine.moe.backends import BackendContext, register_backend
from services.engine.moe.banks import BANK_SCHEMAS
from services.engine.moe.fp8 import dense_experts
from services.engine.moe.reference import ClampedSwiGLU, expert_swiglu, glu

log = get_logger("resident")

GATHER_MAX_ROUTES = 64  # R at or below this takes the decode (graph-capturable) path on CUDA
PREFILL_GEMV_MAX_ROUTES = 2048  # R at or below this (256 tokens at top-8) also takes the Triton GEMV on CUDA


SCALE_BANKS = ("gate_up_scale", "down_scale")  # the fp8_block format's scale banks (banks.py)


def fp8_scales(banks: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fp8 scale banks of ``banks`` (a layer's or the cache's slot banks) as compute keywords; {} when
    the experts are not FP8."""
    return {name: banks[name] for name in SCALE_BANKS if name in banks}


def _pick(scale: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if scale is None else scale[index]


def moe_grouped(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [T, D] · topk_ids [T, A] (-1 = skip) · topk_weights [T, A] · gate_up [E, 2I, D] ·
    down [E, D, I] · act / bias (gate_up_bias [E, 2I], down_bias [E, D]): gpt-oss experts, as
    ``moe_reference`` · gate_up_scale / down_scale: FP8 block scales (fp8.py) -> [T, D] (fp32
    accumulation, returned in hidden's dtype)."""
    T, A = topk_ids.shape
    E = gate_up.shape[0]
    flat = topk_ids.reshape(-1)  # [R]
    order = torch.argsort(flat, stable=True)  # [R] routes grouped by expert, skipped (-1) first
    counts = torch.bincount(flat.clamp(min=-1) + 1, minlength=E + 1).tolist()  # [1 + E]: skipped, e0..
    weights = topk_weights.reshape(-1)  # [R]
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)  # [T, D]
    pos = counts[0]
    for e in range(E):
        n = counts[e + 1]
        if n == 0:
            continue
        routes = order[pos:pos + n]  # [n]
        tok = routes // A  # [n]
        b_gu, b_d = (bias[0][e], bias[1][e]) if bias is not None else (None, None)
        gu, d = dense_experts(gate_up[e], down[e], _pick(gate_up_scale, e), _pick(down_scale, e), hidden.dtype)
        y = expert_swiglu(hidden[tok], gu, d, act, b_gu, b_d)  # [n, D]
        out.index_add_(0, tok, y.float() * weights[routes, None].float())
        pos += n
    return out.to(hidden.dtype)


def moe_gathered(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``moe_grouped``; no host sync (CUDA-graph capturable)."""
    T, A = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [R]
    valid = flat >= 0
    ids = flat.clamp(min=0)  # skipped routes compute expert 0 with weight 0
    w = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)  # [R]
    x = hidden[:, None, :].expand(T, A, hidden.shape[1]).reshape(T * A, 1, -1)  # [R, 1, D] (no sync)
    gu, d = dense_experts(gate_up[ids], down[ids], _pick(gate_up_scale, ids), _pick(down_scale, ids), hidden.dtype)
    h = torch.bmm(x, gu.transpose(1, 2))  # [R, 1, 2I]
    if bias is not None:
        h = h + bias[0][ids][:, None, :]
    a = glu(h, act)  # [R, 1, I]
    y = torch.bmm(a, d.transpose(1, 2))[:, 0]  # [R, D]
    if bias is not None:
        y = y + bias[1][ids]
    return (y.float() * w[:, None]).view(T, A, -1).sum(dim=1).to(hidden.dtype)  # [T, D]


class DecodeKernel:
    """The CUDA decode path: Triton GEMV (``kind="triton"``) or torch gather+bmm (``"torch"``).
    The Triton module is imported on first use only (on CPU-only hosts kernel tests import it under
    TRITON_INTERPRET); if it fails to import, compile or run, this logs why and uses torch from then on."""

    def __init__(self, kind: str = "triton") -> None:
        if kind not in ("triton", "torch"):
            raise ValueError(f"decode kernel must be 'triton' or 'torch', got {kind!r}")
        self.kind = kind
        self._gemv = None

    def __call__(self, hidden, topk_ids, topk_weights, gate_up, down, act: ClampedSwiGLU | None = None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None) -> torch.Tensor:
        scales = (gate_up_scale, down_scale)
        # past decode sizes the torch fallback would gather R experts' weights (GBs): group instead
        fallback = moe_gathered if topk_ids.numel() <= GATHER_MAX_ROUTES else moe_grouped
        if self.kind == "triton":
            try:
                if self._gemv is None:
                    from kernels.moe_gemv import moe_gemv

                    self._gemv = moe_gemv
                return self._gemv(hidden, topk_ids, topk_weights, gate_up, down, *scales, act=act, bias=bias)
            except Exception as e:  # noqa: BLE001 - keep serving; stats() shows the kernel in use
                if torch.cuda.is_current_stream_capturing():
                    raise
                log.warning("Triton moe_gemv unavailable (%s: %s); decode uses torch gather+bmm", type(e).__name__, e)
                self.kind = "torch"
        return fallback(hidden, topk_ids, topk_weights, gate_up, down, act, bias, *scales)


moe_decode = DecodeKernel()  # shared by backends that compute experts on the GPU (resident, offload)


def moe_compute(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act: ClampedSwiGLU | None = None,
                bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts of a step by the cheapest way for its size (module docstring): the GEMV kernels on
    CUDA up to PREFILL_GEMV_MAX_ROUTES routes, the grouped loop beyond and on the CPU. ``act`` / ``bias``:
    gpt-oss experts (every path has them)."""
    R = topk_ids.numel()
    if hidden.is_cuda and (R <= GATHER_MAX_ROUTES or (R <= PREFILL_GEMV_MAX_ROUTES and moe_decode.kind == "triton")):
        return moe_decode(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gate_up_scale, down_scale)
    return moe_grouped(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gate_up_scale, down_scale)


class ResidentBackend:
    """All banks moved to the device once, layer by layer (no full-model temporary). Unquantized banks take
    the model dtype; a quantized format keeps its own dtypes (FP8 stays FP8 on the device)."""

    def __init__(self, ctx: BackendContext) -> None:
        self.device = ctx.device
        self.layers = [{s.name: layer.tensors[s.name].to(ctx.device, s.dtype or ctx.dtype)
                        for s in BANK_SCHEMAS[layer.format]} for layer in ctx.banks.layers]
        self.bias = [None if layer.bias is None else tuple(t.to(ctx.device, ctx.dtype) for t in layer.bias)
                     for layer in ctx.banks.layers]  # gpt-oss: (gate_up_bias [E, 2I], down_bias [E, D])
        self.act = ctx.banks.activation
        self.decode = moe_decode
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] · topk_ids [T, A] · topk_weights [T, A] -> [T, D]."""
        banks = self.layers[moe_layer]
        return moe_compute(hidden, topk_ids, topk_weights, banks["gate_up"], banks["down"], self.act,
                           self.bias[moe_layer], **fp8_scales(banks))

    def stats(self) -> dict:
        return {"backend": MoEBackend.RESIDENT.value, "expert_bytes_on_device": self.nbytes,
                "decode_kernel": self.decode.kind}


@register_backend(MoEBackend.RESIDENT)
def _make_resident(ctx: BackendContext) -> ResidentBackend:
    return ResidentBackend(ctx)

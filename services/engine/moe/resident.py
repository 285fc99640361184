"""The `resident` backend: every expert of every layer on the compute device, no cache.

Legend: T tokens · A experts per token · R = T*A routes · E experts · D hidden · I intermediate.

Ways to compute the routed experts, same maths as ``moe_reference`` (``moe_compute`` picks):
- on CUDA, any size (``moe_decode``: no host sync, static shapes, so a decode step can be captured in a
  CUDA graph; prefills take it too):
  - R <= GEMV_MAX_ROUTES (a token or two): the Triton GEMV (kernels/moe_gemv.py), weights read in place
    once per route. With this few routes an expert rarely meets two of them, and the GEMV's
    one-program-per-route grid streams HBM best.
  - beyond: the fused grouped GEMM (kernels/moe_gemm.py): routes sorted by expert on the device into
    tiles of 16-64 rows, each expert's weights read once per tile on the tensor cores. Qwen3-30B-A3B at
    16 decode streams: 128 routes over ~81 distinct experts, 0.76 GB read per layer instead of the
    GEMV's 1.2 GB; a 4 x 60-token prefill (1920 routes) <= 1.2 GB instead of 18 GB.
  - if Triton fails (import, compile, run): torch gather+bmm up to GATHER_MAX_ROUTES (the R experts'
    weights gathered into [R, ...]: 3x the bytes, capturable) and the grouped loop beyond, logged once.
- grouped (everything on the CPU): routes sorted by expert, one GEMM pair per expert present; reads each
  present expert once. Needs the per-expert counts on the host (one sync), and launches ~8 kernels per
  expert present: ~E x 8 launches per layer (why CUDA takes the kernels above).

Quantized experts (fp8_block, mxfp4) come as ``gate_up_scale`` / ``down_scale`` keywords beside
``gate_up`` / ``down`` together with their format ``fmt`` (``quant_kwargs(fmt, banks)`` picks them out of
a layer's or the cache's banks; the format, not the bank names, says how to read them: moe/dequant.py).
They are dequantized per expert (grouped), per gathered route (gathered) or in the Triton kernels'
registers (GEMV, GEMM; the kernels tell MXFP4's uint8 banks apart by dtype, checked against ``fmt``).
"""

from __future__ import annotations

import torch

from services.common.logging import get_logger
from services.engine.config import MoEBackend
from services.engine.moe.backends import BackendContext, register_backend
from services.engine.moe.banks import BANK_SCHEMAS, GGUF_TYPES, SCALE_BANKS, ExpertFormat
from services.engine.moe.dequant import check_banks, dense_experts
from services.engine.moe.reference import ClampedSwiGLU, expert_swiglu, glu

log = get_logger("resident")

GEMV_MAX_ROUTES = 16  # R at or below: the Triton GEMV on CUDA (2 tokens at top-8); above: the grouped GEMM
GATHER_MAX_ROUTES = 64  # R at or below: torch gather+bmm when Triton is unavailable; above: the grouped loop


def quant_kwargs(fmt: ExpertFormat, banks: dict[str, torch.Tensor]) -> dict:
    """The compute keywords of format ``fmt``'s scale banks in ``banks`` (a layer's or the cache's slot
    banks): {} for unquantized experts, else gate_up_scale, down_scale and fmt."""
    fmt = ExpertFormat(fmt)
    if fmt in GGUF_TYPES:  # scales inside the blocks: the format alone says how to read them
        return {"fmt": fmt}
    if not SCALE_BANKS[fmt]:
        return {}
    return {"gate_up_scale": banks["gate_up_scale"], "down_scale": banks["down_scale"], "fmt": fmt}


def _pick(scale: torch.Tensor | None, index) -> torch.Tensor | None:
    return None if scale is None else scale[index]


def moe_grouped(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, fmt: ExpertFormat = ExpertFormat.UNQUANTIZED) -> torch.Tensor:
    """hidden [T, D] · topk_ids [T, A] (-1 = skip) · topk_weights [T, A] · gate_up [E, 2I, D] ·
    down [E, D, I] · act / bias (gate_up_bias [E, 2I], down_bias [E, D]): gpt-oss experts, as
    ``moe_reference`` · gate_up_scale / down_scale: the scale banks of format ``fmt`` (fp8_block: fp32
    block scales, fp8.py; mxfp4: E8M0 bytes beside packed weights, models/mxfp4.py) -> [T, D] (fp32
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
        gu, d = dense_experts(fmt, gate_up[e], down[e], _pick(gate_up_scale, e), _pick(down_scale, e), hidden.dtype)
        y = expert_swiglu(hidden[tok], gu, d, act, b_gu, b_d)  # [n, D]
        out.index_add_(0, tok, y.float() * weights[routes, None].float())
        pos += n
    return out.to(hidden.dtype)


def moe_gathered(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 gate_up: torch.Tensor, down: torch.Tensor, act: ClampedSwiGLU | None = None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None, fmt: ExpertFormat = ExpertFormat.UNQUANTIZED) -> torch.Tensor:
    """Same contract as ``moe_grouped``; no host sync (CUDA-graph capturable)."""
    T, A = topk_ids.shape
    flat = topk_ids.reshape(-1)  # [R]
    valid = flat >= 0
    ids = flat.clamp(min=0)  # skipped routes compute expert 0 with weight 0
    w = torch.where(valid, topk_weights.reshape(-1).float(), 0.0)  # [R]
    x = hidden[:, None, :].expand(T, A, hidden.shape[1]).reshape(T * A, 1, -1)  # [R, 1, D] (no sync)
    gu, d = dense_experts(fmt, gate_up[ids], down[ids], _pick(gate_up_scale, ids), _pick(down_scale, ids), hidden.dtype)
    h = torch.bmm(x, gu.transpose(1, 2))  # [R, 1, 2I]
    if bias is not None:
        h = h + bias[0][ids][:, None, :]
    a = glu(h, act)  # [R, 1, I]
    y = torch.bmm(a, d.transpose(1, 2))[:, 0]  # [R, D]
    if bias is not None:
        y = y + bias[1][ids]
    return (y.float() * w[:, None]).view(T, A, -1).sum(dim=1).to(hidden.dtype)  # [T, D]


class DecodeKernel:
    """The CUDA path: Triton kernels (``kind="triton"``: the GEMV for a few routes, the grouped GEMM beyond)
    or torch (``"torch"``: gather+bmm, the grouped loop for large R). The Triton modules are imported on
    first use only (on CPU-only hosts kernel tests import them under TRITON_INTERPRET); if one fails to
    import, compile or run, this logs why and uses torch from then on."""

    def __init__(self, kind: str = "triton") -> None:
        if kind not in ("triton", "torch"):
            raise ValueError(f"decode kernel must be 'triton' or 'torch', got {kind!r}")
        self.kind = kind
        self._gemv = self._gemm = None

    def __call__(self, hidden, topk_ids, topk_weights, gate_up, down, act: ClampedSwiGLU | None = None,
                 bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                 down_scale: torch.Tensor | None = None, fmt: ExpertFormat = ExpertFormat.UNQUANTIZED) -> torch.Tensor:
        scales = (gate_up_scale, down_scale)
        R = topk_ids.numel()
        check_banks(fmt, gate_up, down, gate_up_scale, down_scale)  # the kernels tell formats by dtype: agree
        types = GGUF_TYPES.get(ExpertFormat(fmt))  # GGUF: (gate_up's, down's) block type, named to the kernels
        if self.kind == "triton":
            try:
                if self._gemm is None:
                    from kernels.moe_gemm import moe_gemm
                    from kernels.moe_gemv import moe_gemv

                    self._gemv, self._gemm = moe_gemv, moe_gemm
                if R <= GEMV_MAX_ROUTES:
                    return self._gemv(hidden, topk_ids, topk_weights, gate_up, down, *scales, act=act, bias=bias,
                                      gguf_types=types)
                return self._gemm(hidden, topk_ids, topk_weights, gate_up, down, act, bias, *scales, gguf_types=types)
            except Exception as e:  # noqa: BLE001 - keep serving; stats() shows the kernel in use
                if torch.cuda.is_current_stream_capturing():
                    raise
                log.warning("Triton MoE kernels unavailable (%s: %s); experts use torch gather+bmm / the grouped "
                            "loop", type(e).__name__, e)
                self.kind = "torch"
        # past decode sizes gather+bmm would gather R experts' weights (GBs): group instead
        fallback = moe_gathered if R <= GATHER_MAX_ROUTES else moe_grouped
        return fallback(hidden, topk_ids, topk_weights, gate_up, down, act, bias, *scales, fmt)

    def warm(self, hidden: torch.Tensor, top_k: int, gate_up: torch.Tensor, down: torch.Tensor,
             act: ClampedSwiGLU | None = None, bias: tuple[torch.Tensor, torch.Tensor] | None = None,
             **scales) -> int:
        """Compile every Triton specialization a step can meet on these banks (the GEMV, the GEMM with each
        launch config of its table, the alignment): one small call each, so no JIT compile lands on the
        request path. ``hidden`` [>=1, D]: a row of the model's dtype. Returns the calls made (0 on torch)."""
        if self.kind != "triton" or not _on_kernels(hidden):
            return 0
        from kernels.moe_gemm import all_configs

        E = gate_up.shape[0]
        x = hidden[:1].expand(2, -1).contiguous()  # [2, D]
        ids = (torch.arange(2 * top_k, device=hidden.device) % E).view(2, top_k)  # [2, A]
        w = torch.full((2, top_k), 1.0 / top_k, device=hidden.device)
        self(x[:1], ids[:1], w[:1], gate_up, down, act, bias, **scales)  # the GEMV
        calls = 1
        for cfg in all_configs(hidden.device):
            if self.kind != "triton":
                break
            self._gemm(x, ids, w, gate_up, down, act, bias, scales.get("gate_up_scale"), scales.get("down_scale"),
                       config=cfg, gguf_types=GGUF_TYPES.get(scales.get("fmt")))
            calls += 1
        return calls


def _on_kernels(hidden: torch.Tensor) -> bool:
    """Whether the experts of ``hidden`` take the Triton kernels: on CUDA, or everywhere when the model's
    fused ops are forced onto Triton (``models.fused.FORCE``: CPU tests under TRITON_INTERPRET, e.g. the
    check that start-up compiles every kernel specialization requests meet)."""
    from services.engine.models import fused

    return hidden.is_cuda or fused.FORCE is True


moe_decode = DecodeKernel()  # shared by backends that compute experts on the GPU (resident, offload, hybrid)


def moe_compute(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act: ClampedSwiGLU | None = None,
                bias: tuple[torch.Tensor, torch.Tensor] | None = None, gate_up_scale: torch.Tensor | None = None,
                down_scale: torch.Tensor | None = None, fmt: ExpertFormat = ExpertFormat.UNQUANTIZED) -> torch.Tensor:
    """The routed experts of a step by the cheapest way for its size and device (module docstring): the
    Triton GEMV / grouped GEMM on CUDA (``moe_decode``), the grouped loop on the CPU."""
    if _on_kernels(hidden):
        return moe_decode(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gate_up_scale, down_scale, fmt)
    return moe_grouped(hidden, topk_ids, topk_weights, gate_up, down, act, bias, gate_up_scale, down_scale, fmt)


class ResidentBackend:
    """All banks moved to the device once, layer by layer (no full-model temporary). Unquantized banks take
    the model dtype; a quantized format keeps its own dtypes (FP8 stays FP8, MXFP4 packed bytes, on the device)."""

    def __init__(self, ctx: BackendContext) -> None:
        self.device = ctx.device
        self.formats = [layer.format for layer in ctx.banks.layers]
        self.layers = [{s.name: layer.tensors[s.name].to(ctx.device, s.dtype or ctx.dtype)
                        for s in BANK_SCHEMAS[layer.format]} for layer in ctx.banks.layers]
        self.bias = [None if layer.bias is None else tuple(t.to(ctx.device, ctx.dtype) for t in layer.bias)
                     for layer in ctx.banks.layers]  # gpt-oss: (gate_up_bias [E, 2I], down_bias [E, D])
        self.act = ctx.banks.activation
        self.decode = moe_decode
        self.top_k = ctx.top_k
        self.nbytes = sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def forward(self, moe_layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] · topk_ids [T, A] · topk_weights [T, A] -> [T, D]."""
        banks = self.layers[moe_layer]
        return moe_compute(hidden, topk_ids, topk_weights, banks["gate_up"], banks["down"], self.act,
                           self.bias[moe_layer], **quant_kwargs(self.formats[moe_layer], banks))

    def warm(self, hidden: torch.Tensor) -> int:
        """Compile the expert kernels of every step size before serving (DecodeKernel.warm)."""
        first = {fmt: i for i, fmt in reversed(list(enumerate(self.formats)))}  # a layer of each format (GGUF: several)
        return sum(self.decode.warm(hidden, self.top_k, self.layers[i]["gate_up"], self.layers[i]["down"], self.act,
                                    self.bias[i], **quant_kwargs(fmt, self.layers[i])) for fmt, i in first.items())

    def stats(self) -> dict:
        return {"backend": MoEBackend.RESIDENT.value, "expert_bytes_on_device": self.nbytes,
                "decode_kernel": self.decode.kind}


@register_backend(MoEBackend.RESIDENT)
def _make_resident(ctx: BackendContext) -> ResidentBackend:
    return ResidentBackend(ctx)

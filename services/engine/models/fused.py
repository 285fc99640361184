"""Where the model's small fused ops run: one Triton launch each on CUDA, the torch reference elsewhere.

A bs=1 decode step is launch-bound (docs/design.md §6: a few us per kernel even under CUDA-graph replay,
48 layers), so RMSNorm (+ residual add), q/k norm + rope, decode attention (+ KV write) and the router's
softmax/top-k are single Triton kernels on the GPU (kernels/rmsnorm.py, qk_norm_rope.py,
decode_attention.py, route_topk.py), q/k/v (gate/up) are one matmul (``LinearGroup``; everywhere), and
one-row matmuls (q/k/v, o_proj, the router) take a GEMV kernel (``linear``, kernels/gemv.py).
Counted by benchmarks/count_decode_ops.py. On the CPU the torch path runs
(same maths; it is what the parity tests against transformers check). ``FORCE`` makes the CPU take the
Triton path too (under TRITON_INTERPRET: kernel tests, benchmarks/count_decode_ops.py).

If a kernel fails to import or run outside a CUDA-graph capture, the failure is logged once and the
torch path is used from then on (a capture re-raises: a half-captured graph is worse than none).
"""

from __future__ import annotations

import importlib

import torch

from services.common.logging import get_logger

log = get_logger("models.fused")

FORCE: bool | None = None  # None: Triton on CUDA tensors only · True: everywhere · False: never
_broken: set[str] = set()


def enabled(x: torch.Tensor, name: str) -> bool:
    """Whether kernel ``name`` should handle tensor ``x``."""
    if name in _broken or FORCE is False:
        return False
    return FORCE is True or x.is_cuda


_kernels: dict[tuple[str, str], object] = {}


def kernel(module: str, attr: str):
    """``kernels.<module>.<attr>`` (imported on first use, then cached: eager decode calls this ~7x per layer)."""
    fn = _kernels.get((module, attr))
    if fn is None:
        fn = _kernels[(module, attr)] = getattr(importlib.import_module(f"kernels.{module}"), attr)
    return fn


def failed(name: str, exc: Exception) -> None:
    """Record that kernel ``name`` is unusable (re-raises during a CUDA-graph capture)."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise exc
    _broken.add(name)
    log.warning("Triton %s unavailable (%s: %s); using the torch path", name, type(exc).__name__, exc)


def call(name: str, module: str, attr: str, x: torch.Tensor, *args, **kwargs):
    """Run ``kernels.<module>.<attr>(x, *args, **kwargs)`` if enabled for ``x``; None when the caller
    should take its torch path."""
    if not enabled(x, name):
        return None
    try:
        return kernel(module, attr)(x, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - keep serving on the torch path; logged
        failed(name, e)
        return None


GEMV_MAX_ROWS = 1  # rows at or below: kernels/gemv.py (the weight read once per row; cuBLAS beyond)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``torch.nn.functional.linear`` with a decode step's single row on the GEMV kernel (kernels/gemv.py
    says why: cuBLAS's tiles for many rows take 1.5-2x the weight's read time at one row)."""
    if x.dim() == 2 and x.shape[0] <= GEMV_MAX_ROWS and x.stride(-1) == 1 and weight.stride(-1) == 1:
        got = call("gemv", "gemv", "gemv", x, weight, bias)
        if got is not None:
            return got
    return torch.nn.functional.linear(x, weight, bias)


class LinearGroup:
    """Several ``nn.Linear`` of the same input as ONE matmul (q/k/v, gate/up): their weights are
    concatenated on first use and the Linears re-pointed at views of the concatenation, so parameter
    names, ``state_dict`` and later in-place weight copies keep working and no second copy exists.

    Not an nn.Module on purpose (it must not register the Linears twice). If a Linear's weight is
    replaced (``model.to(...)``, a reload), the next call fuses again; during a CUDA-graph capture
    it never allocates and falls back to one matmul per Linear."""

    def __init__(self, *linears: torch.nn.Linear) -> None:
        self.linears = linears
        self.sizes = [lin.out_features for lin in linears]
        self.weight: torch.Tensor | None = None  # [sum(sizes), in]
        self.bias: torch.Tensor | None = None  # [sum(sizes)] or None
        self._ptrs: tuple[int, ...] = ()

    def _fresh(self) -> bool:
        return self._ptrs == tuple(lin.weight.data_ptr() for lin in self.linears)

    def _fuse(self) -> None:
        with torch.inference_mode(False), torch.no_grad():
            weight = torch.cat([lin.weight for lin in self.linears])
            has_bias = self.linears[0].bias is not None
            bias = torch.cat([lin.bias for lin in self.linears]) if has_bias else None
            if weight.is_cuda:  # the old weights are freed below while the cat may still read them
                for lin in self.linears:
                    lin.weight.record_stream(torch.cuda.current_stream(weight.device))
                    if has_bias:
                        lin.bias.record_stream(torch.cuda.current_stream(weight.device))
            off = 0
            for lin, n in zip(self.linears, self.sizes):
                lin.weight = torch.nn.Parameter(weight[off:off + n], requires_grad=lin.weight.requires_grad)
                if has_bias:
                    lin.bias = torch.nn.Parameter(bias[off:off + n], requires_grad=lin.bias.requires_grad)
                off += n
        self.weight, self.bias = weight, bias
        self._ptrs = tuple(lin.weight.data_ptr() for lin in self.linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, sum(sizes)] (the Linears' outputs side by side)."""
        if not self._fresh():
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return torch.cat([lin(x) for lin in self.linears], dim=-1)
            self._fuse()
        return linear(x, self.weight, self.bias)

"""gemv: ``x @ weight.T (+ bias)`` for the few rows of a decode step, one launch, no split-K.

Dimension legend: T rows (tokens) · K input features · N output features.

Why: at T = 1 cuBLAS picks GEMM tiles built for many rows. On the H200 a decode step's q/k/v projection
(K 2048 -> N 5120, 21 MB of bf16) took 8.3 us, the o_proj (4096 -> 2048) 7.8 us plus 1.7 for its split-K
reduction, the router (2048 -> 128) 5.1 us (run 23's kernel profile): all of it in the serial part of a
hybrid layer, where the CPU and the PCIe wait. Reading the weight once at HBM speed is what bounds a
GEMV; this kernel gives each program BLOCK_N whole rows (no partial sums to merge) and enough programs
to cover the SMs.

    y[t, n] = sum_k x[t, k] * weight[n, k]  (+ bias[n]),  fp32 accumulation, rounded once to x's dtype

The reference is ``gemv_ref`` (torch.nn.functional.linear in fp32, rounded once);
tests/kernels/test_gemv.py, timings: benchmarks/bench_gemv.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    N, K,
    stride_x, stride_w, stride_y,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    t = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)  # reduced once after the loop
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_ok = cols < K
        x = tl.load(x_ptr + t * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
        w = tl.load(w_ptr + rows[:, None] * stride_w + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                    other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure torch: x [T, K] · weight [N, K] (· bias [N]) -> [T, N] in x's dtype, computed in fp32."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def pick_blocks(N: int, K: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): benchmarks/bench_gemv.py's sweep on the H200 (run 32, us per call from
    a CUDA graph, cuBLAS in brackets): 2048 -> 5120 4.70 (6.48) with (2, 512, 2); 4096 -> 2048 4.09 (7.55) and
    2048 -> 128 1.86 (4.77) with (2, 1024, 4). Two rows per program: a decode projection has 128-5120
    outputs, and the 132 SMs want several programs each to hide HBM latency."""
    if K <= 2048 and N > 256:
        return 2, 512, 2
    return 2, 1024, 4


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         blocks: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [T, K] (contiguous rows) · weight [N, K] (contiguous) · bias [N] or None -> [T, N] in x's dtype.
    ``blocks`` overrides pick_blocks (the benchmark's sweep)."""
    T, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"gemv: x {tuple(x.shape)} and weight {tuple(weight.shape)} must share K, with contiguous rows")
    block_n, block_k, warps = blocks or pick_blocks(N, K)
    y = torch.empty((T, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n), T)](
        x, weight, bias if bias is not None else weight, y, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y

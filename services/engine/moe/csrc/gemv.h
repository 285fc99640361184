// Row-block GEMV micro-kernels of the CPU MoE executor, one set per ISA (chosen at run time).
//
// One call computes, for `nrows` weight rows W[r] (K elements, row stride ldw) and `ntok` input
// vectors X[t] (K elements each):
//     Y[t][r]  = dot(W[r], X[t])                 (scale == nullptr)
//     Y[t][r] += scale[t] * dot(W[r], X[t])      (scale != nullptr: the weighted down projection)
// Products accumulate in fp32. Each weight row block is loaded once and used for every token of the
// block, so at bs=1 the kernel is a pure stream over the expert's bytes (the point: DRAM bandwidth).
#pragma once
#include <cstdint>

namespace tandem {

enum class WDtype : int { F32 = 0, BF16 = 1 };

struct GemvArgs {
  const void* W;        // weight rows, WDtype elements
  int64_t ldw;          // elements between consecutive rows
  int nrows;
  int K;
  const void* const* X; // ntok input pointers: bf16 (uint16) for the AVX-512-BF16 bf16 kernel, else fp32
  int ntok;
  float* const* Y;      // ntok output pointers, nrows floats each
  const float* scale;   // nullptr or ntok route weights
};

using GemvFn = void (*)(const GemvArgs&);
using ReadFn = double (*)(const float* p, int64_t n);  // STREAM-style read: sum of n floats

// Kernels per ISA. `x_bf16` says whether the kernel wants X in bf16 (only avx512bf16 with bf16 weights).
struct IsaKernels {
  const char* name;
  GemvFn gemv_f32;   // fp32 weights, fp32 X
  GemvFn gemv_bf16;  // bf16 weights
  bool bf16_wants_bf16_x;
  ReadFn read;       // the CPU read ceiling's kernel (benchmarks)
};

IsaKernels select_kernels(const char* force);

// Software prefetch in every GEMV's weight stream: `bytes` ahead at `level` (0 L1, 1 L2, 2 NTA);
// bytes <= 0 turns it off. Process-wide; set while no job runs.
void set_stream_prefetch(int bytes, int level);  // force: nullptr/"" = best supported, else an ISA name

}  // namespace tandem
